"""sparsetrain.integrations.transformers against transformers' own eager implementations, on tiny
random-initialised models of each family (config objects, no downloads): the same weights and
batches through attn_implementation / experts_implementation "eager" and "sparsetrain", logits
and every parameter's gradient compared within the dtype's tolerance (fp32 tight, bf16 loose);
fresh random data each run (the seed is in the failure message). Attention: causal, GQA, left and
right padding (valid positions only), packed documents from position_ids and from cu_seq_lens
against each document run alone, a sliding window, generation with a cache. Experts: Qwen3-MoE,
Mixtral, DeepSeek-V3 (its own router: group limits and expert bias), routings that leave experts
empty. Refusals name what is not supported (gpt-oss's experts and sinks, dropout, softcap, a
window over documents). CUDA cases run where a GPU is (bf16), and skip visibly without one."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: torch tests skipped")
transformers = pytest.importorskip("transformers", reason="transformers is not installed: integration tests skipped")

import sparsetrain.integrations.transformers as sti  # noqa: E402
from transformers import (AutoModelForCausalLM, DeepseekV3Config, GptOssConfig, MistralConfig,  # noqa: E402
                          MixtralConfig, Qwen3MoeConfig)

VOCAB = 97
# Head dims of 128 where sparsetrain's attention runs: the CUDA build's minimal kernel set has them.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="no CUDA GPU: CUDA cases skipped"))]


def qwen3_moe(**kw):
    args = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=128, num_experts=8, num_experts_per_tok=2)
    return Qwen3MoeConfig(**{**args, **kw})


def mixtral(**kw):
    return MixtralConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_local_experts=6, num_experts_per_tok=2,
                         **kw)


def deepseek_v3(**kw):
    return DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16,
                            num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=0, n_group=4,
                            topk_group=2, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=16, qk_nope_head_dim=48,
                            v_head_dim=64, **kw)


# The experts' cases: one MoE layer, so that both sides' routers see the same hidden states (a
# later layer's router, after our rounding, could choose otherwise at a near tie).
FAMILIES = {"qwen3_moe": lambda: qwen3_moe(num_hidden_layers=1), "mixtral": mixtral, "deepseek_v3": deepseek_v3}
# The attention's cases: dense MLPs (no router to flip), two layers.
DENSE = [0, 1]


def tolerance(dtype):
    # fp32: the two sides sum in different orders; bf16: every layer's activations are rounded to
    # 2^-8, two layers deep, and a router may pick differently at a near tie (rare at these sizes).
    return dict(rtol=2e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=6e-2, atol=6e-2)


def pair(config, device, dtype, attn="eager", experts="eager", seed=0):
    """(transformers' eager model, the same weights on sparsetrain's implementations)."""
    torch.manual_seed(seed)
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager",
                                           experts_implementation="eager", dtype=dtype).to(device)
    got = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn,
                                           experts_implementation=experts, dtype=dtype).to(device)
    got.load_state_dict(ref.state_dict())
    return ref, got


def grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def compare_step(ref, got, seed, dtype, ref_kwargs, got_kwargs=None, valid=None):
    """One forward + backward of each on the same batch: logits (at `valid` positions) and every
    gradient within the dtype's tolerance, nothing NaN."""
    got_kwargs = ref_kwargs if got_kwargs is None else got_kwargs
    out_ref, out_got = ref(**ref_kwargs), got(**got_kwargs)
    dlogits = torch.randn_like(out_ref.logits)
    if valid is not None:
        dlogits = dlogits * valid[..., None]
    (out_ref.logits.float() * dlogits).sum().backward()
    (out_got.logits.float() * dlogits).sum().backward()
    a, b = out_ref.logits, out_got.logits
    if valid is not None:
        a, b = a[valid], b[valid]
    assert not torch.isnan(b).any(), f"NaN logits (seed {seed})"
    torch.testing.assert_close(b.float(), a.float(), **tolerance(dtype), msg=f"logits (seed {seed})")
    g_ref, g_got = grads(ref), grads(got)
    assert g_ref.keys() == g_got.keys(), f"parameters with gradients differ (seed {seed})"
    for name in g_ref:
        scale = g_ref[name].abs().max().clamp_min(1e-6)
        assert not torch.isnan(g_got[name]).any(), f"{name}: NaN gradient (seed {seed})"
        torch.testing.assert_close(g_got[name].float() / scale, g_ref[name].float() / scale, **tolerance(dtype),
                                   msg=f"{name}'s gradient (seed {seed})")


def fresh_seed():
    return int(np.random.SeedSequence().entropy % 2**31)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_experts_match_eager(family, device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    seed = fresh_seed()
    ref, got = pair(FAMILIES[family](), device, dtype, experts="sparsetrain", seed=seed)
    ids = torch.randint(0, VOCAB, (2, 37), device=device)
    compare_step(ref, got, seed, dtype, dict(input_ids=ids))
    assert any("_sparsetrain_mlp" in m.__dict__ for m in got.modules()), "sparsetrain's experts did not run"
    assert not any("_sparsetrain_mlp" in m.__dict__ for m in ref.modules())


@pytest.mark.parametrize("device", DEVICES)
def test_experts_with_empty_and_tiny_experts(device):
    """32 experts, 3 tokens x top-2: most experts get no row, the rest one or two."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    seed = fresh_seed()
    ref, got = pair(qwen3_moe(num_experts=32, num_hidden_layers=1), device, dtype, experts="sparsetrain", seed=seed)
    compare_step(ref, got, seed, dtype, dict(input_ids=torch.randint(0, VOCAB, (1, 3), device=device)))


@pytest.mark.parametrize("device", DEVICES)
def test_attention_causal_gqa_and_padding(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    seed = fresh_seed()
    ref, got = pair(qwen3_moe(mlp_only_layers=DENSE), device, dtype, attn="sparsetrain", seed=seed)
    ids = torch.randint(0, VOCAB, (2, 45), device=device)
    compare_step(ref, got, seed, dtype, dict(input_ids=ids))
    ref.zero_grad(), got.zero_grad()
    mask = torch.ones(2, 45, dtype=torch.long, device=device)
    mask[0, :5] = 0  # left padding
    mask[1, -7:] = 0  # right padding
    compare_step(ref, got, seed, dtype, dict(input_ids=ids, attention_mask=mask), valid=mask.bool())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("packing", ["position_ids", "cu_seq_lens"])
def test_attention_packed_documents_match_each_document_alone(packing, device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    seed = fresh_seed()
    ref, got = pair(qwen3_moe(mlp_only_layers=DENSE), device, dtype, attn="sparsetrain", seed=seed)
    lengths = [20, 1, 13, 11]
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), device=device)
    position_ids = torch.cat([torch.arange(n, device=device) for n in lengths]).unsqueeze(0)
    if packing == "position_ids":  # DataCollatorWithFlattening's form
        kwargs = dict(input_ids=ids, position_ids=position_ids)
    else:  # its return_flash_attn_kwargs=True form
        cu = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32, device=device)
        kwargs = dict(input_ids=ids, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                      max_length_q=max(lengths), max_length_k=max(lengths))
    out = got(**kwargs).logits
    starts = np.cumsum([0] + lengths)
    alone = torch.cat([ref(input_ids=ids[:, s:e]).logits for s, e in zip(starts[:-1], starts[1:])], 1)
    torch.testing.assert_close(out.float(), alone.float(), **tolerance(dtype), msg=f"seed {seed}")
    # transformers' own packed rule (position_ids, no cache), also over two rows packed differently
    ids2 = torch.randint(0, VOCAB, (2, sum(lengths)), device=device)
    pos2 = torch.stack([position_ids[0], torch.cat([torch.arange(n, device=device) for n in (7, 30, 8)])])
    compare_step(ref, got, seed, dtype, dict(input_ids=ids2, position_ids=pos2, use_cache=False))


@pytest.mark.parametrize("device", DEVICES)
def test_attention_sliding_window(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    seed = fresh_seed()
    def mistral(window):  # dense, every layer windowed (Mistral's sliding_window)
        return MistralConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=1, num_key_value_heads=1, sliding_window=window)

    ref, got = pair(mistral(16), device, dtype, attn="sparsetrain", seed=seed)
    ids = torch.randint(0, VOCAB, (2, 53), device=device)
    compare_step(ref, got, seed, dtype, dict(input_ids=ids))
    _, causal = pair(mistral(None), device, dtype, attn="sparsetrain", seed=seed)
    assert not torch.allclose(causal(input_ids=ids).logits, got(input_ids=ids).logits), "the window had no effect"


def test_attention_generation_with_a_cache():
    """Greedy decoding: the first step's queries are all the prompt's, then one query over a longer
    key sequence (bottom-right causal)."""
    ref, got = pair(qwen3_moe(), "cpu", torch.float32, attn="sparsetrain", experts="sparsetrain")
    prompt = torch.randint(0, VOCAB, (1, 9))
    a = ref.generate(prompt, max_new_tokens=6, do_sample=False)
    b = got.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(a, b)


def test_runs_are_bitwise_repeatable():
    _, got = pair(qwen3_moe(), "cpu", torch.float32, attn="sparsetrain", experts="sparsetrain")
    ids = torch.randint(0, VOCAB, (2, 33))
    runs = []
    for _ in range(2):
        got.zero_grad()
        got(input_ids=ids, labels=ids).loss.backward()
        runs.append({n: g.clone() for n, g in grads(got).items()})
    assert all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])


def test_gpt_oss_experts_are_refused_naming_their_gate():
    config = GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2)
    model = AutoModelForCausalLM.from_config(config, experts_implementation="sparsetrain", dtype=torch.float32)
    with pytest.raises(ValueError, match="_apply_gate"):
        model(input_ids=torch.randint(0, VOCAB, (1, 5)))


class _Attention(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize("kwargs,match", [
    (dict(dropout=0.1), "dropout"),
    (dict(softcap=30.0), "softcapping"),
    (dict(s_aux=torch.zeros(4)), "sinks"),
    (dict(sliding_window=8, attention_mask=torch.ones(1, 16, dtype=torch.bool)), "sliding window"),
])
def test_unsupported_attention_is_refused_by_name(kwargs, match):
    q, k = torch.randn(1, 4, 16, 16), torch.randn(1, 2, 16, 16)
    mask = kwargs.pop("attention_mask", None)
    module = _Attention().train()
    with pytest.raises(ValueError, match=match):
        sti.sparsetrain_attention_forward(module, q, k, k, mask, **kwargs)
