"""Pooling models (runner="pooling"): embeddings offline (`LLM.embed`) and over HTTP
(`/v1/embeddings`), against a transformers forward in fp32 pooled the same way.

A tiny random Qwen3 checkpoint is saved twice: as a base model (`Qwen3Model`, transformers'
AutoModel: no LM head, names without `model.`), which "auto" starts as a pooling model, and as a
CausalLM started with runner="pooling". Chunked prefill, batching and prefix-cache hits must
give the vectors one prompt alone gets; every request frees its KV blocks.
"""

import base64
import functools
import json
import shutil

import numpy as np
import openai
import pytest
import requests
import torch
import torch.nn.functional as F
import transformers

from conftest import make_tiny_checkpoint, make_tiny_config, make_tiny_tokenizer
from nanovllm import LLM, PoolingParams, SamplingParams
from test_server import Server

ENGINE = dict(dtype="float32", num_kvcache_blocks=128, enforce_eager=True)
PROMPTS = [[5, 9, 11], list(range(20, 61)), [7] * 17, list(range(100, 133))]


def _randomised(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter drawn at random, norms around 1 (as conftest's checkpoints are)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.1 * torch.randn_like(param)) if "norm" in name else param.normal_(0, 0.1)
    return model


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("base-model")
    config = make_tiny_config("Qwen3ForCausalLM")
    _randomised(transformers.AutoModel.from_config(config)).save_pretrained(path)
    make_tiny_tokenizer(config.vocab_size).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def causal_checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("causal-lm"))


@pytest.fixture(scope="module")
def base_llm(base_checkpoint):
    return LLM(str(base_checkpoint), **ENGINE)


@functools.cache
def transformers_base_model(checkpoint) -> torch.nn.Module:
    """The checkpoint's decoder without LM head (a CausalLM's loads so too), in fp32."""
    return transformers.AutoModel.from_pretrained(checkpoint, dtype=torch.float32)


def reference(checkpoint, prompt: list[int], pooling_type: str, normalize: bool = True) -> torch.Tensor:
    """transformers' final-normed hidden states in fp32, pooled as `pooling_type`."""
    model = transformers_base_model(checkpoint)
    with torch.no_grad():
        hidden = model(torch.tensor([prompt])).last_hidden_state[0]
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[pooling_type]
    return F.normalize(vector, dim=-1) if normalize else vector


def cosine(a, b) -> float:
    return F.cosine_similarity(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32),
                               dim=0).item()


def test_auto_runner_pools_a_base_model_and_generates_with_a_causal_lm(base_llm, causal_checkpoint):
    config = base_llm.llm_engine.config
    assert (config.runner, config.pooler_config.pooling_type, config.pooler_config.normalize) == ("pooling", "LAST",
                                                                                                   True)
    assert base_llm.llm_engine.executor.model.lm_head is None
    causal = LLM(str(causal_checkpoint), **ENGINE)
    assert causal.llm_engine.config.runner == "generate"
    assert causal.llm_engine.config.pooler_config is None


def test_base_model_vectors_match_transformers(base_llm, base_checkpoint):
    outputs = base_llm.embed(PROMPTS, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.prompt_token_ids == prompt and output.finished
        vector = output.outputs.embedding
        assert len(vector) == 64 and abs(np.linalg.norm(vector) - 1) < 1e-5
        assert cosine(vector, reference(base_checkpoint, prompt, "LAST")) > 0.9999


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_causal_lm_as_pooling_model_matches_transformers(causal_checkpoint, pooling_type):
    pooler = {"pooling_type": pooling_type, "normalize": False}
    llm = LLM(str(causal_checkpoint), runner="pooling", pooler_config=pooler, **ENGINE)
    assert llm.llm_engine.executor.model.lm_head is None
    for prompt, output in zip(PROMPTS, llm.embed(PROMPTS, use_tqdm=False)):
        expected = reference(causal_checkpoint, prompt, pooling_type, normalize=False)
        assert cosine(output.outputs.embedding, expected) > 0.9999
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), expected, atol=1e-4, rtol=1e-4)
    normalized = llm.embed(PROMPTS[1], PoolingParams(normalize=True), use_tqdm=False)[0].outputs.embedding
    assert cosine(normalized, reference(causal_checkpoint, PROMPTS[1], pooling_type)) > 0.9999
    assert abs(np.linalg.norm(normalized) - 1) < 1e-5


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_chunked_batched_and_cached_prompts_give_the_vectors_of_one_prompt_alone(base_checkpoint, pooling_type):
    """Prompts of different lengths batched, long ones prefilled over several steps (16 tokens a
    step), and a prompt seen before (a prefix-cache hit for LAST; MEAN must compute every
    position), against each prompt embedded alone in one step; no block stays taken."""
    pooler = {"pooling_type": pooling_type}
    alone = LLM(str(base_checkpoint), pooler_config=pooler, enable_prefix_caching=False, **ENGINE)
    expected = [alone.embed(p, use_tqdm=False)[0].outputs.embedding for p in PROMPTS]
    chunked = LLM(str(base_checkpoint), pooler_config=pooler, max_num_batched_tokens=16, **ENGINE)
    for _ in range(2):  # the second time, the prompts' full blocks are in the prefix cache
        outputs = chunked.embed(PROMPTS, use_tqdm=False)
        for output, vector in zip(outputs, expected):
            np.testing.assert_allclose(output.outputs.embedding, vector, atol=1e-5)
        metrics = chunked.get_metrics()
        assert metrics["num_free_blocks"] == metrics["num_kvcache_blocks"]
        assert metrics["num_running"] == metrics["num_waiting"] == 0
    assert (metrics["prefix_cache_hit_tokens"] > 0) == (pooling_type == "LAST")


def test_tensor_parallel_rank_0_pools_what_one_rank_pools(base_checkpoint):
    engine = dict(ENGINE, max_num_batched_tokens=16, pooler_config={"pooling_type": "MEAN"})
    expected = [o.outputs.embedding for o in LLM(str(base_checkpoint), **engine).embed(PROMPTS, use_tqdm=False)]
    llm = LLM(str(base_checkpoint), tensor_parallel_size=2, **engine)
    try:
        for output, vector in zip(llm.embed(PROMPTS, use_tqdm=False), expected):
            np.testing.assert_allclose(output.outputs.embedding, vector, atol=1e-5)
    finally:
        llm.llm_engine.executor.shutdown()


def test_dimensions_keep_the_first_values_then_normalise(base_llm):
    full = base_llm.embed(PROMPTS[1], PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding
    cut = base_llm.embed(PROMPTS[1], PoolingParams(dimensions=8), use_tqdm=False)[0].outputs.embedding
    assert len(cut) == 8
    np.testing.assert_allclose(cut, F.normalize(torch.tensor(full[:8]), dim=0).numpy(), atol=1e-6)
    raw = base_llm.embed(PROMPTS[1], PoolingParams(dimensions=8, normalize=False), use_tqdm=False)[0]
    np.testing.assert_allclose(raw.outputs.embedding, full[:8], atol=1e-6)
    with pytest.raises(ValueError, match="dimensions must be at most the model's embedding size 64"):
        base_llm.embed(PROMPTS[0], PoolingParams(dimensions=65), use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions must be an integer >= 1"):
        PoolingParams(dimensions=0)


def test_the_wrong_runner_is_a_clear_error(base_llm, base_checkpoint, causal_checkpoint):
    with pytest.raises(ValueError, match="started as a pooling model.*cannot generate"):
        base_llm.generate([1, 2, 3], SamplingParams(max_tokens=2), use_tqdm=False)
    causal = LLM(str(causal_checkpoint), **ENGINE)
    with pytest.raises(ValueError, match="not started as a pooling model.*runner='pooling'"):
        causal.embed([1, 2, 3], use_tqdm=False)
    with pytest.raises(ValueError, match="base model without an LM head.*runner='pooling'"):
        LLM(str(base_checkpoint), runner="generate", **ENGINE)
    with pytest.raises(ValueError, match="pooler_config applies to a pooling model only"):
        LLM(str(causal_checkpoint), pooler_config={"pooling_type": "MEAN"}, **ENGINE)
    with pytest.raises(ValueError, match="pooling_type must be one of LAST, MEAN, CLS"):
        LLM(str(base_checkpoint), pooler_config={"pooling_type": "MAX"}, **ENGINE)
    with pytest.raises(ValueError, match="unknown fields \\['softmax'\\]"):
        LLM(str(base_checkpoint), pooler_config={"softmax": True}, **ENGINE)
    with pytest.raises(ValueError, match="runner must be one of"):
        LLM(str(base_checkpoint), runner="embed", **ENGINE)


def _sentence_transformers_copy(source, target, modules: list[str], pooling: dict):
    shutil.copytree(source, target)
    types = {"Pooling": "1_Pooling", "Normalize": "2_Normalize", "Dense": "2_Dense"}
    listed = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    listed += [{"idx": i, "name": str(i), "path": types[m], "type": f"sentence_transformers.models.{m}"}
               for i, m in enumerate(modules, start=1)]
    (target / "modules.json").write_text(json.dumps(listed))
    (target / "1_Pooling").mkdir()
    (target / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **pooling}))
    return target


def test_sentence_transformers_files_set_the_defaults(causal_checkpoint, tmp_path):
    mean = _sentence_transformers_copy(causal_checkpoint, tmp_path / "mean", ["Pooling", "Normalize"],
                                       {"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False})
    llm = LLM(str(mean), **ENGINE)  # a CausalLM's architecture, but modules.json: auto pools
    pooler = llm.llm_engine.config.pooler_config
    assert (llm.llm_engine.config.runner, pooler.pooling_type, pooler.normalize) == ("pooling", "MEAN", True)
    vector = llm.embed(PROMPTS[1], use_tqdm=False)[0].outputs.embedding
    assert cosine(vector, reference(causal_checkpoint, PROMPTS[1], "MEAN")) > 0.9999
    # The user's pooler_config wins over the files.
    overridden = LLM(str(mean), pooler_config={"normalize": False}, **ENGINE).llm_engine.config.pooler_config
    assert (overridden.pooling_type, overridden.normalize) == ("MEAN", False)
    unnormalized = _sentence_transformers_copy(causal_checkpoint, tmp_path / "last", ["Pooling"],
                                               {"pooling_mode_lasttoken": True})
    pooler = LLM(str(unnormalized), **ENGINE).llm_engine.config.pooler_config
    assert (pooler.pooling_type, pooler.normalize) == ("LAST", False)
    dense = _sentence_transformers_copy(causal_checkpoint, tmp_path / "dense", ["Pooling", "Dense"],
                                        {"pooling_mode_lasttoken": True})
    with pytest.raises(ValueError, match="modules the engine does not run.*Dense"):
        LLM(str(dense), **ENGINE)
    max_pooled = _sentence_transformers_copy(causal_checkpoint, tmp_path / "max", ["Pooling"],
                                             {"pooling_mode_max_tokens": True})
    with pytest.raises(ValueError, match="pools by \\['pooling_mode_max_tokens'\\].*pooler_config"):
        LLM(str(max_pooled), **ENGINE)
    chosen = LLM(str(max_pooled), pooler_config={"pooling_type": "CLS"}, **ENGINE).llm_engine.config.pooler_config
    assert chosen.pooling_type == "CLS"


# ----- the server -----

@pytest.fixture(scope="module")
def servers(base_checkpoint, causal_checkpoint, tmp_path_factory):
    logs = tmp_path_factory.mktemp("embedding-server-logs")
    pooling = Server(base_checkpoint, logs / "pooling.log", "--max-prompts-per-request", "4")
    generating = Server(causal_checkpoint, logs / "generating.log")
    yield pooling, generating
    pooling.stop()
    generating.stop()


@pytest.fixture(scope="module")
def pooling_server(servers):
    servers[0].wait_ready()
    return servers[0]


@pytest.fixture(scope="module")
def generating_server(servers):
    servers[1].wait_ready()
    return servers[1]


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_server_embeddings_match_llm_embed(pooling_server, base_llm):
    client = _client(pooling_server)
    texts = ["hello world", "a longer input, which takes a few more tokens than the first"]
    tokenizer = base_llm.get_tokenizer()
    expected = [o.outputs.embedding for o in base_llm.embed([tokenizer.encode(t) for t in texts], use_tqdm=False)]
    as_floats = client.embeddings.create(model="tiny", input=texts, encoding_format="float")
    assert [d.index for d in as_floats.data] == [0, 1] and as_floats.model == "tiny"
    for datum, vector in zip(as_floats.data, expected):
        np.testing.assert_allclose(datum.embedding, vector, atol=1e-5)
    n_tokens = sum(len(tokenizer.encode(t)) for t in texts)
    assert (as_floats.usage.prompt_tokens, as_floats.usage.total_tokens) == (n_tokens, n_tokens)
    # The client asks for base64 by default and decodes it.
    as_base64 = client.embeddings.create(model="tiny", input=texts[1])
    np.testing.assert_allclose(as_base64.data[0].embedding, expected[1], atol=1e-5)
    by_ids = client.embeddings.create(model="tiny", input=PROMPTS[:2], encoding_format="float")
    for datum, output in zip(by_ids.data, base_llm.embed(PROMPTS[:2], use_tqdm=False)):
        np.testing.assert_allclose(datum.embedding, output.outputs.embedding, atol=1e-5)
    one_list = client.embeddings.create(model="tiny", input=PROMPTS[0], dimensions=8, encoding_format="float")
    cut = base_llm.embed(PROMPTS[0], PoolingParams(dimensions=8), use_tqdm=False)[0].outputs.embedding
    np.testing.assert_allclose(one_list.data[0].embedding, cut, atol=1e-5)


def test_server_base64_is_little_endian_float32(pooling_server, base_llm):
    response = requests.post(f"{pooling_server.url}/v1/embeddings",
                             json={"input": PROMPTS[2], "encoding_format": "base64", "user": "someone"}, timeout=60)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
    decoded = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, base_llm.embed(PROMPTS[2], use_tqdm=False)[0].outputs.embedding, atol=1e-5)


@pytest.mark.parametrize("body, param, message", [
    ({"input": []}, "input", "input must be a string, a list of token ids, or a non-empty list of either"),
    ({"input": [[1, 2], []]}, "input", "never empty"),
    ({"input": "hi", "encoding_format": "binary"}, "encoding_format", "'float' or 'base64'"),
    ({"input": "hi", "dimensions": 0}, "dimensions", "dimensions must be an integer >= 1"),
    ({"input": "hi", "dimensions": 65}, "dimensions", "at most the model's embedding size 64"),
    ({"input": [[1], [2], [3], [4], [5]]}, "input", "at most 4 inputs"),
    ({"input": [[1, 999]]}, "input", "token ids must be integers in [0, 320)"),
    ({"input": "hi", "model": "other"}, "model", "does not exist"),
])
def test_server_rejects_bad_embedding_requests_and_keeps_serving(pooling_server, body, param, message):
    response = requests.post(f"{pooling_server.url}/v1/embeddings", json=body, timeout=60)
    assert response.status_code == (404 if param == "model" else 400), response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert _client(pooling_server).embeddings.create(model="tiny", input="still serving").data


def test_a_pooling_server_refuses_to_generate(pooling_server):
    client = _client(pooling_server)
    with pytest.raises(openai.BadRequestError, match="serves embeddings.*/v1/embeddings"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="serves embeddings.*/v1/embeddings"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert client.embeddings.create(model="tiny", input="still serving").data
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_a_generating_server_refuses_to_embed(generating_server):
    client = _client(generating_server)
    with pytest.raises(openai.BadRequestError, match="not started as a pooling model.*--runner pooling"):
        client.embeddings.create(model="tiny", input="hi")
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].text is not None
