"""The `baton` command and the composition root: the top floor, above the roles
(`normal_engine/`, `prompt_engine/`, `completion_engine/`), the router and the `baton` library.
`engine_main` picks a role's worker by name from one table; `launcher` (`baton up`) starts every
process of a deployment."""
