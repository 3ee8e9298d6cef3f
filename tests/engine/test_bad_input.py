"""Every bad input gets a specific ValueError, nothing is queued, and the engine keeps serving."""

import json
import os
import shutil
from types import SimpleNamespace

import pytest
from helpers import small_llm
from tiny_models import make_tiny_model

from specdec import SamplingParams

OK = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_bad")
    make_tiny_model(str(path), "qwen2", seed=4)
    return str(path)


@pytest.fixture(scope="module")
def llm(model_dir):
    return small_llm(model_dir, dtype="float32", block_size=4, max_model_len=64)


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, r"top_p=0\.0 is invalid; allowed: a number in \(0, 1\]"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": float("nan")}, "temperature"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"seed": 2**63}, r"seed=9223372036854775808 is invalid; allowed: None or an integer in \[0, 2\*\*63 - 1\]"),
    ({"seed": 2**70}, "seed"),
    ({"seed": -1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"seed": True}, "seed"),
])
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("call,match", [
    (lambda llm: llm.generate(prompt_token_ids=[[]], sampling_params=OK), "prompt is empty"),
    (lambda llm: llm.generate(prompt_token_ids=[[1, 2, 10**6]], sampling_params=OK), "outside the vocabulary"),
    (lambda llm: llm.generate(prompt_token_ids=[[1, -3]], sampling_params=OK), "outside the vocabulary"),
    (lambda llm: llm.generate(prompt_token_ids=[[1] * 60], sampling_params=SamplingParams(max_tokens=10)),
     "exceeds max_model_len=64"),
    (lambda llm: llm.generate(["hi", "there"], [OK]), "1 sampling_params for 2 prompts"),
    (lambda llm: llm.generate(), "exactly one of prompts or prompt_token_ids"),
    (lambda llm: llm.generate([""], OK), "prompt is empty"),
    (lambda llm: llm.generate(["ok"], {"temperature": 0}), "must be a SamplingParams or a list of them .* got dict"),
    (lambda llm: llm.generate("hi", {"temperature": 0}), "got dict"),
    (lambda llm: llm.generate(["a", "b"], [OK, {"temperature": 0}]), r"sampling_params\[1\] must be a SamplingParams, "
                                                                     "got dict"),
    (lambda llm: llm.generate(["Hello", ""], OK), "prompt 1 of 2: the prompt is empty"),
    (lambda llm: llm.generate(prompt_token_ids=[[1, 2], [3, 10**6]], sampling_params=OK),
     r"prompt 1 of 2: prompt token ids \[1000000\] are outside"),
    (lambda llm: llm.generate(123, OK), "prompts must be a string or a list of strings, got int"),
    (lambda llm: llm.generate(prompt_token_ids="abc", sampling_params=OK), "prompt_token_ids must be a list"),
])
def test_bad_requests_raise_and_the_engine_keeps_serving(llm, call, match):
    with pytest.raises(ValueError, match=match):
        call(llm)
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(prompt_token_ids=[5, 6, 7], sampling_params=OK)[0].outputs[0].token_ids) == 4


def test_one_bad_request_in_a_batch_rejects_the_call_before_anything_runs(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(prompt_token_ids=[[1, 2], [3, 10**6], [4]], sampling_params=OK)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs,match", [
    ({"dtype": "int8"}, "dtype 'int8' is not supported"),
    ({"device": "tpu"}, "device 'tpu' is not supported"),
    ({"max_model_len": 10**6}, "max_model_len must be an integer in"),
    ({"num_kv_blocks": 2}, "cannot hold one sequence"),
    ({"prepack_weights": "yes"}, "prepack_weights must be None"),
    ({"prepack_weights": True, "dtype": "float16"}, "prepack_weights=True needs a CPU float32"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be an integer >= 1"),
    ({"max_num_batched_tokens": -5}, "max_num_batched_tokens"),
    ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1"),
])
def test_bad_engine_arguments(model_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        small_llm(model_dir, **kwargs)


def test_missing_and_corrupt_weights(model_dir, tmp_path):
    missing = tmp_path / "missing"
    shutil.copytree(model_dir, missing)
    os.remove(missing / "model.safetensors")
    with pytest.raises(ValueError, match="no \\*.safetensors weights"):
        small_llm(str(missing))
    corrupt = tmp_path / "corrupt"
    shutil.copytree(model_dir, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="corrupt or unreadable"):
        small_llm(str(corrupt))
    with pytest.raises(ValueError, match="neither an existing directory"):
        small_llm(str(tmp_path / "nowhere" / "x"))
    bad_cfg = tmp_path / "badcfg"
    shutil.copytree(model_dir, bad_cfg)
    (bad_cfg / "config.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        small_llm(str(bad_cfg))


def test_weights_of_the_wrong_shape(model_dir, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(model_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="has shape"):
        small_llm(str(other))


def test_folder_without_tokenizer_takes_token_ids_only(model_dir, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare)
    os.remove(bare / "tokenizer.json")
    llm = small_llm(str(bare), dtype="float32", max_model_len=64)
    assert llm.generate(prompt_token_ids=[1, 2, 3], sampling_params=OK)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="no tokenizer.json: pass prompt_token_ids"):
        llm.generate("hello", OK)


def test_offline_hub_id_not_in_cache_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError, match="not in the local Hugging Face cache"):
        small_llm("nobody/not-a-model")


def test_revision_reaches_the_hub_and_is_refused_for_local_paths(monkeypatch, tiny_pair):
    """``LLM(revision=)`` downloads that revision of a hub repo id (the hub faked: it serves tiny_pair's target);
    a revision with a local folder is refused rather than ignored; a gated repo names HF_TOKEN."""
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError

    asked = []

    def snapshot_download(repo_id, revision=None, **kwargs):
        asked.append((repo_id, revision))
        if repo_id == "org/gated":
            raise GatedRepoError("403 Client Error: access to this model is restricted",
                                 response=SimpleNamespace(headers={}, status_code=403, request=None))
        return tiny_pair[0]

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    llm = small_llm("org/tiny", revision="v1.0", dtype="float32", max_model_len=64)
    assert asked == [("org/tiny", "v1.0")]
    assert llm.generate(prompt_token_ids=[1, 2, 3], sampling_params=OK)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="revision='v1.0' is for a hub repo id"):
        small_llm(tiny_pair[0], revision="v1.0")
    with pytest.raises(ValueError, match="revision must be"):
        small_llm("org/tiny", revision="")
    with pytest.raises(ValueError, match="gated repository: accept its license on the hub, then set HF_TOKEN"):
        small_llm("org/gated")


def test_a_seed_at_the_top_of_the_range_runs(llm):
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=2**63 - 1, ignore_eos=True)
    first = llm.generate(prompt_token_ids=[5, 6, 7], sampling_params=params)[0].outputs[0].token_ids
    assert first == llm.generate(prompt_token_ids=[5, 6, 7], sampling_params=params)[0].outputs[0].token_ids
    assert len(first) == 4


def test_sampling_params_changed_after_construction_are_checked_again(llm):
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=1)
    params.seed = 2**70
    with pytest.raises(ValueError, match="seed"):
        llm.generate(prompt_token_ids=[5, 6, 7], sampling_params=params)
    assert not llm.engine.has_unfinished_requests()
