"""Every supported model family on the disaggregated path: a prompt engine and a completion
engine (separate processes, NIXL between them) per family, each family's tiny seeded
checkpoint written by transformers (tests/model/test_families.py), greedy tokens identical to
transformers' own greedy decoding of the same folder. The co-located path is
tests/model/test_families.py."""

from __future__ import annotations

import uuid

import pytest

from baton.protocol import SamplingOptions
from kv_transfer import protocol as kvproto
from tests.cluster import EngineProcess, start_all, wait_whole
from tests.model.test_families import FAMILIES, NUM_NEW, _prompts, _reference, _write

pytestmark = pytest.mark.slow

ENGINE_ARGS = ["--device", "cpu", "--num-blocks", "64", "--max-num-batched-tokens", "32"]
GREEDY = SamplingOptions(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """family -> (reference model, prompt engine, completion engine); every engine starts at
    once, so their imports and loads overlap."""
    logs = tmp_path_factory.mktemp("families-pd")
    deployed, engines = {}, []
    try:
        for family, (config_class, model_class, overrides) in FAMILIES.items():
            folder = tmp_path_factory.mktemp(family)
            ref = _write(folder, config_class, model_class, **overrides)
            args = ["--model", str(folder), *ENGINE_ARGS]
            prompt = EngineProcess("prompt-engine", f"{family}-prompt", logs, args=args)
            completion = EngineProcess("completion-engine", f"{family}-completion", logs,
                                       args=args)
            engines += [prompt, completion]
            deployed[family] = (ref, prompt, completion)
        start_all(engines)
        yield deployed
    finally:
        for engine in engines:
            engine.stop()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_disaggregated_matches_transformers(families, family: str) -> None:
    ref, prompt, completion = families[family]
    for ids in _prompts():
        req_id = uuid.uuid4().hex
        with prompt.client() as c:
            first = c.generate(ids, GREEDY, req_id=req_id, timeout_s=120)
        assert first.kv_handle and len(first.token_ids) == 1, first
        with completion.client() as c:
            rest = c.generate(ids, GREEDY, req_id=req_id, timeout_s=120,
                              kv_handle=first.kv_handle, first_token_id=first.token_ids[0])
        assert rest.finish_reason == "length", rest.error
        assert first.token_ids + rest.token_ids == _reference(ref, ids), (family, len(ids))
    wait_whole([prompt, completion])


def test_s42_mistral_hand_off_pulls_only_in_window_blocks(families) -> None:
    """Mistral's window (8 tokens, blocks of 16): the completion engine allocates and pulls
    only the last of the 40-token prompt's 3 blocks (the first decode query, at 40, sees [33,
    40]); the prompt engine leased all 3. Tokens still equal transformers'."""
    ref, prompt, completion = families["mistral_swa"]
    ids = _prompts()[2]
    assert len(ids) == 40
    before = completion.stats().extra
    req_id = uuid.uuid4().hex
    with prompt.client() as c:
        first = c.generate(ids, GREEDY, req_id=req_id, timeout_s=120)
    with completion.client() as c:
        rest = c.generate(ids, GREEDY, req_id=req_id, timeout_s=120,
                          kv_handle=first.kv_handle, first_token_id=first.token_ids[0])
    after = completion.stats().extra
    assert len(kvproto.decode_handle(first.kv_handle).block_ids) == 3
    assert after["kv_blocks_pulled"] - before["kv_blocks_pulled"] == 1
    assert after["kv_blocks_reused"] - before["kv_blocks_reused"] == 0
    assert first.token_ids + rest.token_ids == _reference(ref, ids)
    wait_whole([prompt, completion])
