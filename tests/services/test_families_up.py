"""`baton up --model FOLDER` for a family other than Llama, as a user starts it: the router
reads the folder's tokenizer and limits, one NORMAL engine and a prompt + completion pair load
the family's checkpoint, and the router's static path rule sends the short prompts co-located
and the long one disaggregated. Through the official `openai` client (token-id prompts), every
completion equals transformers' greedy tokens over the same folder, on both paths.

The engines of every family are checked one by one on both paths by
tests/model/test_families.py (co-located) and tests/services/test_families_disaggregated.py
(prompt + completion processes); what only `baton up` adds is the router's side, which is the
same for every family (`load_model_info` reads tokenizer.json and config.json), so one family
runs the whole deployment here and every family's folder goes through `load_model_info`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.model.test_families import FAMILIES, NUM_NEW, _prompts, _reference, _write

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from baton_up import start_baton_up, wait_back_and_whole  # noqa: E402 - bench/baton_up.py

pytestmark = pytest.mark.slow

FAMILY = "gemma3"  # local and global layers, Q/K norms, two RoPE tables: the newest family
ENGINE_ARGS = ["--device", "cpu", "--num-blocks", "64", "--max-num-batched-tokens", "32",
               "--num-threads", "1"]
THRESHOLD = 20  # prompts of _prompts(): 12 and 13 tokens co-located, 40 disaggregated


def test_router_reads_every_family_folder(tmp_path_factory) -> None:
    from router.text import load_model_info

    for family, (config_class, model_class, overrides) in FAMILIES.items():
        folder = tmp_path_factory.mktemp(f"info-{family}")
        _write(folder, config_class, model_class, **overrides)
        info = load_model_info(str(folder))
        assert info.name == folder.name and info.max_model_len > 0, family
        ids = [5, 17, 300]
        assert info.tokenizer.encode(" ".join(f"t{i}" for i in ids), add_special_tokens=False) \
            == ids, family


def test_router_stops_on_the_checkpoints_own_eos_ids(tmp_path) -> None:
    """A chat checkpoint ends its turn on ids its tokenizer does not call EOS
    (generation_config.json, config.json): the router stops on each (vocabulary-checked)."""
    import json

    from router.text import load_model_info

    config_class, model_class, overrides = FAMILIES["qwen3"]
    _write(tmp_path, config_class, model_class, **{**overrides, "eos_token_id": 9})
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9, 99999]}))
    assert load_model_info(str(tmp_path)).stop_token_ids == [2, 7, 9]  # tokenizer's </s> first


def test_baton_up_serves_a_family_on_both_paths(tmp_path_factory) -> None:
    from openai import OpenAI

    config_class, model_class, overrides = FAMILIES[FAMILY]
    folder = tmp_path_factory.mktemp(FAMILY)
    reference = _write(folder, config_class, model_class, **overrides)
    baton = start_baton_up(1, 1, ENGINE_ARGS, [
        "--normal-engines", "1", "--model", str(folder), "--no-cpu-pinning",
        "--pd-threshold-tokens", str(THRESHOLD)])
    try:
        client = OpenAI(base_url=f"{baton.base_url}/v1", api_key="none", max_retries=0,
                        timeout=120)
        for ids in _prompts():
            out = client.completions.create(model=folder.name, prompt=ids, max_tokens=NUM_NEW,
                                            temperature=0, extra_body={"ignore_eos": True})
            got = [int(t) for t in re.findall(r"t(\d+)", out.choices[0].text)]
            assert got == _reference(reference, ids), (FAMILY, len(ids))
        paths = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'baton_router_path_total\{path="(\w+)",reason="threshold"\} (\S+)',
            _get(f"{baton.base_url}/metrics"))}
        assert paths == {"colocated": 2.0, "disaggregated": 1.0}, paths
        wait_back_and_whole(baton, [])  # no block owned, no lease, no pull on any engine
    finally:
        baton.stop()


def _get(url: str) -> str:
    import httpx

    return httpx.get(url, timeout=10).text
