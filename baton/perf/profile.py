"""A machine's engine costs as a versioned JSON profile (schema: docs/profile.md), torch-free.

`baton profile` measures a real engine on a grid and fits each cost with least squares
(`fit_linear`); the simulator and the mock runner predict with `Profile.step_ms` and
`Profile.transfer_ms`. A profile is checked on load: every field is named in the error when it
is missing or of the wrong kind, and a version this code does not know is refused.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

PROFILE_VERSION = 3
# Version 1: the prefill features of PREFILL_FEATURES_V1; versions 1 and 2: the decode
# features of DECODE_FEATURES_V2.
READ_VERSIONS = (1, 2, 3)

# The features of each fitted cost, in the order of its coefficients (docs/profile.md). Prefill,
# with q_i the tokens a step computes for sequence i and k_i its context after the step:
# tokens = sum q_i, tokens_sq = (sum q_i)^2 / 1000 (what grows with the step's whole batch of
# tokens), self_kpairs = sum q_i^2 / 1000 (each chunk's tokens attending to each other),
# cached_kpairs = sum q_i (k_i - q_i) / 1000 (attending to the context cached before the step).
PREFILL_FEATURES = ("const", "tokens", "tokens_sq", "self_kpairs", "cached_kpairs")
PREFILL_FEATURES_V1 = ("const", "tokens", "attention_kpairs")  # kpairs: sum q_i * k_i / 1000
# Decode, with k_i each row's context: batch = the rows, context_ktokens = sum k_i / 1000,
# single_row = 1 for a step of one row, else 0 (the CPU backend's int4 kernel unpacks a weight
# block once for a tile of up to 8 rows: one row pays what two do; on the AMD host of 7
# December 2026 a linear fit priced one row at 64 tokens 12-13% under its time, docs/profile.md).
DECODE_FEATURES = ("const", "batch", "context_ktokens", "single_row")
DECODE_FEATURES_V2 = ("const", "batch", "context_ktokens")
PREPARE_FEATURES = ("const", "tokens")  # the router's prepare: tokens = the prompt's length
# A decode row new to an engine (a completion engine's pulled request): tokens = its context.
ADMIT_FEATURES = ("const", "tokens")


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the field."""


@dataclass
class FitError:
    """How well a fit predicts the grid points it was not fitted on."""

    num_fit: int = 0
    num_held_out: int = 0
    mean_rel_err: float = 0.0  # |predicted - measured| / measured, mean over held-out points
    max_rel_err: float = 0.0


@dataclass
class LinearCost:
    """milliseconds = sum(coef[i] * feature[i]), features as named in `features`."""

    features: tuple[str, ...]
    coef: tuple[float, ...]
    fit: FitError = field(default_factory=FitError)

    def predict(self, values: Sequence[float]) -> float:
        return max(0.0, sum(c * v for c, v in zip(self.coef, values, strict=True)))


@dataclass
class PathCost:
    """What the serving path adds to a request's engine work, measured on mock engines of the
    profile (simulator/calibrate.py): the router and the wires (HTTP, routing, ZMQ both ways)
    before the first token, and a disaggregated request's hand-off (the first token back to the
    router, the completion engine's admission, lease and pull, its commit) beyond the
    profile's transfer time; and the engine loop's own work between two steps (sending a
    step's outputs, taking in what came meanwhile: an engine's `baton_engine_loop_seconds_total`
    less its busy seconds, a step)."""

    request_ms: float = 0.0
    handoff_ms: float = 0.0
    num_requests: int = 0  # the lone requests each median was taken over
    # Optional in a file: those written before it was measured lack it (0: steps back to back).
    step_gap_ms: float = 0.0
    # The CPU the router and a streaming client take for the engines' outputs: per step that
    # emits tokens and per token emitted (simulator/calibrate.py). Where they share a host's
    # cores with its engines (`FleetConfig.service_cores`), the simulator takes it from the
    # engines' steps once no core is idle. Optional in a file (0: not measured).
    service_step_ms: float = 0.0
    service_token_ms: float = 0.0


@dataclass
class Contention:
    """How much longer a step takes while another engine of the same host runs a step of the
    other kind: a decode step (of one row, of several) beside a prompt step, a prompt step
    beside a decode step (each factor >= 1, the step's time then over its time alone). Engines
    on one host share its cores, memory bandwidth and caches. `baton profile` measures the
    factors last between its engine and a second engine process of the model
    (baton/perf/contention.py): on the 2-core AMD host of 7 December 2026, 1.00-1.14 (a decode
    step of one row suffers most). What the bare engines leave out (the router, the client, the
    importer's thread on the same cores) is not in them. Steps of the same kind side by side
    (two completion engines on one host) are not measured, and the simulator does not slow
    them. With several others stepping at once, their excesses add (`slowdown`)."""

    decode_beside_prefill: float = 1.0  # a decode step of one row
    batch_decode_beside_prefill: float = 1.0  # a decode step of several rows
    prefill_beside_decode: float = 1.0

    def slowdown(self, prompt_run: bool, num_rows: int, others_prompt: Sequence[bool]) -> float:
        """The factor on a step of this kind (of `num_rows` rows) while engines running steps
        of `others_prompt`'s kinds share its host (1 alone, or beside steps of its own kind)."""
        factor = (self.prefill_beside_decode if prompt_run else self.decode_beside_prefill
                  if num_rows == 1 else self.batch_decode_beside_prefill)
        return 1.0 + (factor - 1.0) * sum(other != prompt_run for other in others_prompt)


CONTENTION_FACTORS = ("decode_beside_prefill", "batch_decode_beside_prefill",
                      "prefill_beside_decode")


@dataclass
class ModelInfo:
    """What was measured: the simulated engines take their pool and block size from here."""

    name: str  # the model file or folder's name
    fingerprint: str  # the engine's model fingerprint (model, KV layout, quantization)
    quantization: str
    dtype: str
    block_size: int
    num_blocks: int  # the measured engine's pool, null block included
    kv_bytes_per_block: int
    vocab_size: int
    max_position: int


@dataclass
class Profile:
    """One machine's costs for one model (all times in milliseconds unless named _s)."""

    model: ModelInfo
    prefill: LinearCost  # a prompt step's forward (PREFILL_FEATURES)
    decode: LinearCost  # a decode step's forward (DECODE_FEATURES)
    sample_row_ms: float  # the engine's work per sampled row beyond the forward
    step_overhead_ms: float  # the engine's work per step beyond the forward
    transfer_latency_ms: float  # one KV pull: fixed part
    transfer_bytes_per_ms: float  # one KV pull: bytes moved per millisecond
    engine_start_s: float  # process start to ready (weights loaded, pool allocated)
    # A grammar-constrained sampled row's work beyond a plain row's (its token mask computed in
    # the engine core, applied in the sampler). 0 in files measured before it was (docs/profile.md).
    grammar_row_ms: float = 0.0
    # The router's work on a request before any engine sees it (its prompt tokenized,
    # PREPARE_FEATURES). None in files measured before it was: no delay (docs/profile.md).
    prepare: LinearCost | None = None
    # The serving path's own latency (PathCost). None in files measured before it was, or with
    # `baton profile --no-path`: the simulator adds nothing (docs/profile.md).
    path: PathCost | None = None
    # How steps slow each other on one host (Contention). None in files measured before it
    # was, or with `baton profile --no-contention`: engines sharing a host do not slow each
    # other in the simulator (docs/profile.md).
    contention: Contention | None = None
    # What a decode step costs more for each row new to its engine (ADMIT_FEATURES): a
    # completion engine's first step of a pulled request gathers its K/V from the pool into
    # the backend's decode rows. None in files measured before it was: nothing (docs/profile.md).
    admit: LinearCost | None = None
    machine: dict = field(default_factory=dict)  # host, cpu, threads, when
    version: int = PROFILE_VERSION

    # ------------------------------------------------------------------ predictions
    def step_ms(self, prompt_run: bool, seqlens_q: np.ndarray, seqlens_k: np.ndarray,
                num_sampled: int, num_grammar: int = 0) -> float:
        """Predicted time of one engine step (forward + the engine's own work); `num_grammar`
        of the `num_sampled` rows follow a grammar."""
        if prompt_run:
            fwd = self.prefill.predict(prefill_features(seqlens_q, seqlens_k,
                                                        self.prefill.features))
        else:
            fwd = self.decode.predict(decode_features(seqlens_k, self.decode.features))
        return fwd + self.own_work_ms(num_sampled, num_grammar)

    def own_work_ms(self, num_sampled: int, num_grammar: int = 0) -> float:
        """The engine's own share of a step (everything but the forward)."""
        return (self.step_overhead_ms + self.sample_row_ms * num_sampled
                + self.grammar_row_ms * num_grammar)

    def admit_ms(self, context_tokens: int) -> float:
        """What a decode step costs more for a row new to its engine, of `context_tokens`
        (0 without a measured `admit`)."""
        return 0.0 if self.admit is None else self.admit.predict((1.0, float(context_tokens)))

    def prepare_ms(self, num_tokens: int) -> float:
        """Predicted time of the router's prepare of a prompt of `num_tokens` tokens."""
        return 0.0 if self.prepare is None else self.prepare.predict((1.0, float(num_tokens)))

    def request_path_ms(self) -> float:
        """What the router and the wires add to a request before its first token (0 without
        a measured `path`)."""
        return 0.0 if self.path is None else self.path.request_ms

    def handoff_path_ms(self) -> float:
        """What a disaggregated hand-off takes beyond `transfer_ms` (0 without a `path`)."""
        return 0.0 if self.path is None else self.path.handoff_ms

    def step_gap_ms(self) -> float:
        """The engine loop's own work before each step (0 without a measured `path`)."""
        return 0.0 if self.path is None else self.path.step_gap_ms

    def service_cpu_ms(self, num_tokens: int) -> float:
        """The router's and a streaming client's CPU for one step's `num_tokens` outputs (0
        without a measured `path`, or for a step that emitted none)."""
        if self.path is None or num_tokens <= 0:
            return 0.0
        return self.path.service_step_ms + self.path.service_token_ms * num_tokens

    def transfer_ms(self, num_blocks: int) -> float:
        """Predicted time of pulling `num_blocks` KV blocks (0 blocks: nothing to pull)."""
        if num_blocks <= 0:
            return 0.0
        return (self.transfer_latency_ms
                + num_blocks * self.model.kv_bytes_per_block / self.transfer_bytes_per_ms)

    def scaled(self, prefill: float, decode: float | None = None) -> Profile:
        """The same profile on an engine whose prompt steps take `prefill` times as long and
        whose decode steps `decode` times (default: `prefill`'s); the engine's own work per
        step and row, and a new decode row's, go with `decode` (most steps are decode steps).
        The router's prepare, the path and KV pulls are unchanged. What a speed probe
        (simulator/calibrate.py `speed_probe`) says this host runs at now."""
        decode = prefill if decode is None else decode
        for factor in (prefill, decode):
            if not (math.isfinite(factor) and factor > 0):
                raise ProfileError(f"a speed factor must be a finite number > 0, got {factor}")
        return replace(self, prefill=_scaled_cost(self.prefill, prefill),
                       decode=_scaled_cost(self.decode, decode),
                       sample_row_ms=self.sample_row_ms * decode,
                       step_overhead_ms=self.step_overhead_ms * decode,
                       grammar_row_ms=self.grammar_row_ms * decode,
                       admit=None if self.admit is None else _scaled_cost(self.admit, decode))

    def with_link(self, bandwidth_gbit_s: float, latency_ms: float) -> Profile:
        """The same profile over another link: `bandwidth_gbit_s` Gbit/s, `latency_ms` per pull."""
        if bandwidth_gbit_s <= 0 or latency_ms < 0:
            raise ProfileError(f"link bandwidth must be > 0 and latency >= 0, got "
                               f"{bandwidth_gbit_s} Gbit/s, {latency_ms} ms")
        d = to_dict(self)
        d["transfer"] = {"latency_ms": latency_ms, "bytes_per_ms": bandwidth_gbit_s * 1e9 / 8e3}
        return from_dict(d)


def _scaled_cost(cost: LinearCost, factor: float) -> LinearCost:
    return replace(cost, coef=tuple(c * factor for c in cost.coef))


def prefill_features(seqlens_q: np.ndarray, seqlens_k: np.ndarray,
                     features: tuple[str, ...] = PREFILL_FEATURES) -> tuple[float, ...]:
    """A prompt step's features: PREFILL_FEATURES, or a version-1 file's PREFILL_FEATURES_V1."""
    q = np.asarray(seqlens_q, dtype=np.float64)
    k = np.asarray(seqlens_k, dtype=np.float64)
    if tuple(features) == PREFILL_FEATURES_V1:
        return 1.0, float(q.sum()), float((q * k).sum()) / 1e3
    tokens = float(q.sum())
    return (1.0, tokens, tokens * tokens / 1e3, float((q * q).sum()) / 1e3,
            float((q * (k - q)).sum()) / 1e3)


def decode_features(seqlens_k: np.ndarray, features: tuple[str, ...] = DECODE_FEATURES
                    ) -> tuple[float, ...]:
    """A decode step's features: DECODE_FEATURES, or a version-1/2 file's DECODE_FEATURES_V2."""
    k = np.asarray(seqlens_k, dtype=np.float64)
    linear = (1.0, float(k.size), float(k.sum()) / 1e3)
    return linear if tuple(features) == DECODE_FEATURES_V2 else (*linear, float(k.size == 1))


def fit_grid(grid: dict) -> tuple[LinearCost, LinearCost]:
    """(prefill, decode) fitted with this version's features to a grid's raw points (`baton
    profile`'s `machine.grid`: `[q, k, forward ms]` per prompt step, `[k, forward ms]` per
    decode step). ProfileError when a point is malformed."""
    try:
        pre = [(prefill_features(np.asarray(q), np.asarray(k)), float(ms))
               for q, k, ms in grid["prefill"]]
        dec = [(decode_features(np.asarray(k)), float(ms)) for k, ms in grid["decode"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ProfileError(f"machine.grid: not a grid of [q, k, ms] prefill points and [k, ms] "
                           f"decode points ({type(exc).__name__}: {exc})") from None
    if not pre or not dec:
        raise ProfileError("machine.grid: no prefill or no decode points to fit")
    return (fit_linear(PREFILL_FEATURES, [x for x, _ in pre], [y for _, y in pre]),
            fit_linear(DECODE_FEATURES, [x for x, _ in dec], [y for _, y in dec]))


def refit(p: Profile) -> Profile:
    """The profile with its prompt-step and decode-step costs fitted again, with this
    version's features, to the raw points it keeps (`machine.grid`); everything else as
    measured. ProfileError for a file without its grid (written before 6 December 2026)."""
    grid = p.machine.get("grid")
    if not isinstance(grid, dict):
        raise ProfileError("machine.grid: this profile keeps no grid to fit again (measure "
                           "again with `baton profile`)")
    prefill, decode = fit_grid(grid)
    return replace(p, prefill=prefill, decode=decode, version=PROFILE_VERSION,
                   machine={**p.machine, "refitted": {"from_version": p.version,
                                                      "at": time.strftime("%Y-%m-%dT%H:%M:%S")}})


# ------------------------------------------------------------------ fitting
def fit_linear(features: tuple[str, ...], rows: Sequence[Sequence[float]],
               measured_ms: Sequence[float], hold_every: int = 4,
               relative: bool = True) -> LinearCost:
    """Least squares on the relative error over the grid, every `hold_every`-th point held back
    to measure the error (then refitted on all points). Relative, not absolute: a grid spans
    ~30x in step time (a 16-token prompt to 1024 tokens behind 1536), the noise of a shared
    host grows with the step, and predictions are judged by relative error; absolute least
    squares lets the longest points set every coefficient, short steps left to chance.
    Coefficients are >= 0 (no cost runs backwards): a feature whose coefficient comes out
    negative is dropped and the rest refitted (non-negative least squares). `relative=False`:
    plain least squares, for a cost measured as a difference of two steps (`admit`), whose
    points may be ~0 or below it by noise."""
    x = np.asarray(rows, dtype=np.float64)
    y = np.asarray(measured_ms, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != len(features) or len(y) != len(x):
        raise ValueError(f"{len(features)} features per row and one time per row wanted, got "
                         f"{x.shape} rows and {len(y)} times")
    held = np.zeros(len(y), dtype=bool)
    if len(y) >= 2 * len(features) and hold_every > 1:
        held[hold_every - 1::hold_every] = True
    coef = _lstsq(x[~held], y[~held], relative)
    err = FitError(num_fit=int((~held).sum()), num_held_out=int(held.sum()))
    if held.any():
        rel = np.abs(x[held] @ coef - y[held]) / np.maximum(y[held], 1e-9)
        err.mean_rel_err, err.max_rel_err = float(rel.mean()), float(rel.max())
    return LinearCost(tuple(features), tuple(float(c) for c in _lstsq(x, y, relative)), err)


def _lstsq(x: np.ndarray, y: np.ndarray, relative: bool = True) -> np.ndarray:
    """min sum(((x @ coef - y) / y)^2) over coef >= 0: each row weighted by 1 / its time (an
    active set: the most negative coefficient leaves, the others are refitted); not
    `relative`: every row weighted 1."""
    w = 1.0 / np.maximum(np.abs(y), 1e-9) if relative else np.ones(len(y))
    xw, yw = x * w[:, None], y * w
    active = np.ones(x.shape[1], dtype=bool)
    coef = np.zeros(x.shape[1])
    while active.any():
        coef[:] = 0.0
        coef[active] = np.linalg.lstsq(xw[:, active], yw, rcond=None)[0]
        if (coef >= 0).all():
            break
        active[int(np.argmin(coef))] = False
    return np.maximum(coef, 0.0)


# ------------------------------------------------------------------ JSON
def to_dict(p: Profile) -> dict:
    return {
        "version": p.version, "machine": p.machine, "model": asdict(p.model),
        "prefill": _cost_dict(p.prefill), "decode": _cost_dict(p.decode),
        "sampling": {"row_ms": p.sample_row_ms, "step_ms": p.step_overhead_ms,
                     "grammar_row_ms": p.grammar_row_ms},
        "transfer": {"latency_ms": p.transfer_latency_ms, "bytes_per_ms": p.transfer_bytes_per_ms},
        "engine_start_s": p.engine_start_s,
        **({"prepare": _cost_dict(p.prepare)} if p.prepare is not None else {}),
        **({"path": asdict(p.path)} if p.path is not None else {}),
        **({"contention": asdict(p.contention)} if p.contention is not None else {}),
        **({"admit": _cost_dict(p.admit)} if p.admit is not None else {}),
    }


def _cost_dict(c: LinearCost) -> dict:
    return {"features": list(c.features), "coef": list(c.coef), "fit": asdict(c.fit)}


def save(p: Profile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(to_dict(p), indent=1) + "\n")


def load(path: str | Path) -> Profile:
    """Read and check a profile file; ProfileError naming the file and the bad field."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ProfileError(f"{path}: not a readable JSON profile: {exc}") from None
    try:
        return from_dict(data)
    except ProfileError as exc:
        raise ProfileError(f"{path}: {exc}") from None


def from_dict(data: object) -> Profile:
    d = _obj(data, "profile")
    version = _get(d, "version", int, "profile")
    if version not in READ_VERSIONS:
        raise ProfileError(f"profile version {version} is not supported (this Baton reads "
                           f"versions {', '.join(map(str, READ_VERSIONS))}); measure again "
                           f"with `baton profile`")
    m = _obj(_get(d, "model", dict, "profile"), "model")
    model = ModelInfo(
        **{k: _get(m, k, str, "model") for k in ("name", "fingerprint", "quantization", "dtype")},
        **{k: _get(m, k, int, "model", minimum=1) for k in (
            "block_size", "num_blocks", "kv_bytes_per_block", "vocab_size", "max_position")})
    if model.num_blocks < 2:
        raise ProfileError(f"model.num_blocks must be >= 2, got {model.num_blocks}")
    sampling = _get(d, "sampling", dict, "profile")
    transfer = _get(d, "transfer", dict, "profile")
    machine = d.get("machine", {})
    if not isinstance(machine, dict):
        raise ProfileError(f"machine must be an object, got {type(machine).__name__}")
    return Profile(
        model=model,
        prefill=_cost(d, "prefill", PREFILL_FEATURES_V1 if version == 1 else PREFILL_FEATURES),
        decode=_cost(d, "decode", DECODE_FEATURES_V2 if version < 3 else DECODE_FEATURES),
        sample_row_ms=_get(sampling, "row_ms", float, "sampling", minimum=0),
        step_overhead_ms=_get(sampling, "step_ms", float, "sampling", minimum=0),
        # Optional: version-1 files written before grammar rows were measured lack it.
        grammar_row_ms=_get(sampling, "grammar_row_ms", float, "sampling", minimum=0)
        if "grammar_row_ms" in sampling else 0.0,
        transfer_latency_ms=_get(transfer, "latency_ms", float, "transfer", minimum=0),
        transfer_bytes_per_ms=_get(transfer, "bytes_per_ms", float, "transfer", positive=True),
        engine_start_s=_get(d, "engine_start_s", float, "profile", minimum=0),
        # Optional: files written before the router's prepare was measured lack it.
        prepare=_cost(d, "prepare", PREPARE_FEATURES) if "prepare" in d else None,
        # Optional: files written before the serving path was measured lack it.
        path=_path(d["path"]) if "path" in d else None,
        # Optional: files written before contention was measured lack it.
        contention=_contention(d["contention"]) if "contention" in d else None,
        # Optional: files written before a new decode row's cost was measured lack it.
        admit=_cost(d, "admit", ADMIT_FEATURES) if "admit" in d else None,
        machine=machine, version=version)


def _path(value: object) -> PathCost:
    d = _obj(value, "path")
    return PathCost(request_ms=_get(d, "request_ms", float, "path", minimum=0),
                    handoff_ms=_get(d, "handoff_ms", float, "path", minimum=0),
                    num_requests=_get(d, "num_requests", int, "path", minimum=0),
                    # Optional: files written before it was measured lack it.
                    **{k: _get(d, k, float, "path", minimum=0) for k in _OPTIONAL_PATH
                       if k in d})


# PathCost's fields a file may lack (written before they were measured): 0 then.
_OPTIONAL_PATH = ("step_gap_ms", "service_step_ms", "service_token_ms")


def _contention(value: object) -> Contention:
    d = _obj(value, "contention")
    return Contention(**{k: _get(d, k, float, "contention", minimum=1.0)
                         for k in CONTENTION_FACTORS})


def _cost(d: dict, name: str, features: tuple[str, ...]) -> LinearCost:
    c = _obj(_get(d, name, dict, "profile"), name)
    got = _get(c, "features", list, name)
    if tuple(got) != features:
        raise ProfileError(f"{name}.features must be {list(features)}, got {got}")
    coef = _get(c, "coef", list, name)
    if len(coef) != len(features) or not all(_is_num(v) and v >= 0 for v in coef):
        raise ProfileError(f"{name}.coef must be {len(features)} finite numbers >= 0, got {coef}")
    fit = c.get("fit", {})
    if not isinstance(fit, dict):
        raise ProfileError(f"{name}.fit must be an object, got {type(fit).__name__}")
    try:
        err = FitError(**fit)
    except TypeError as exc:
        raise ProfileError(f"{name}.fit: {exc}") from None
    return LinearCost(features, tuple(float(v) for v in coef), err)


def _obj(value: object, where: str) -> dict:
    if not isinstance(value, dict):
        raise ProfileError(f"{where} must be a JSON object, got {type(value).__name__}")
    return value


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _get(d: dict, key: str, kind: type, where: str, minimum: float | None = None,
         positive: bool = False):
    name = key if where == "profile" else f"{where}.{key}"
    if key not in d:
        raise ProfileError(f"missing field {name}")
    value = d[key]
    if kind is float:
        ok = _is_num(value)
        value = float(value) if ok else value
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ProfileError(f"field {name} must be {kind.__name__}, got {value!r}")
    if minimum is not None and value < minimum:
        raise ProfileError(f"field {name} must be >= {minimum}, got {value!r}")
    if positive and value <= 0:
        raise ProfileError(f"field {name} must be > 0, got {value!r}")
    return value
