"""Mixtral's mixture-of-experts feed-forward against transformers (logits and greedy decoding are
covered by the "mixtral" family in test_model.py): routing, both checkpoint layouts, compile."""
import json

import pytest
import torch

from conftest import make_hf_model
from decode import generate
from load import load_model
from scripts.convert_hf_checkpoint import convert_hf_checkpoint


def our_logits(model, ids):
    model.setup_caches(max_batch_size=ids.shape[0], max_seq_length=ids.shape[1])
    return model(ids, torch.arange(ids.shape[1]))


def hub_layout(hf_state: dict) -> dict:
    """transformers 5's fused in-memory experts -> the per-expert layout of real hub checkpoints."""
    out = {}
    for name, t in hf_state.items():
        prefix, _, leaf = name.rpartition(".mlp.")
        if leaf == "gate.weight":
            out[f"{prefix}.block_sparse_moe.gate.weight"] = t
        elif leaf == "experts.gate_up_proj":
            for e, (w1, w3) in enumerate(zip(*t.chunk(2, dim=1))):
                out[f"{prefix}.block_sparse_moe.experts.{e}.w1.weight"] = w1.contiguous()
                out[f"{prefix}.block_sparse_moe.experts.{e}.w3.weight"] = w3.contiguous()
        elif leaf == "experts.down_proj":
            for e, w2 in enumerate(t):
                out[f"{prefix}.block_sparse_moe.experts.{e}.w2.weight"] = w2.contiguous()
        else:
            out[name] = t
    return out


@pytest.mark.parametrize("layout", ["hub", "fused"])
def test_both_checkpoint_layouts(layout, tmp_path):
    from safetensors.torch import save_file
    hf = make_hf_model("mixtral", seed=1)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state  # transformers 5 keeps experts fused
    (tmp_path / "hf").mkdir()
    save_file(hub_layout(state) if layout == "hub" else state, tmp_path / "hf" / "model.safetensors")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf.config.to_dict()))
    model = load_model(convert_hf_checkpoint(tmp_path))
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(our_logits(model, ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_missing_expert_is_an_error(tmp_path):
    from safetensors.torch import save_file
    hf = make_hf_model("mixtral", seed=1)
    state = hub_layout(hf.state_dict())
    del state["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    (tmp_path / "hf").mkdir()
    save_file(state, tmp_path / "hf" / "model.safetensors")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf.config.to_dict()))
    with pytest.raises(ValueError, match="layer 1: w2 is missing experts"):
        convert_hf_checkpoint(tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_matches_transformers(dtype, converted):
    _, path = converted("mixtral")
    hf = make_hf_model("mixtral").to(dtype)  # the same weights as `converted`, not shared with other tests
    model = load_model(path, precision=dtype)
    router_inputs, hf_routes = [], []
    hf_router = hf.model.layers[1].mlp.gate
    hooks = [hf_router.register_forward_hook(lambda m, args, out: hf_routes.append(out)),
             model.layers[1].feed_forward.register_forward_pre_hook(lambda m, args: router_inputs.append(args[0]))]
    ids = torch.randint(0, 256, (3, 50), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hf(ids)
        our_logits(model, ids)
        weights, experts = model.layers[1].feed_forward.route(router_inputs[0].reshape(-1, hf.config.hidden_size))
    for h in hooks:
        h.remove()
    _, hf_weights, hf_experts = hf_routes[0]
    # Inputs to the router agree only to rounding, so a near-tie may flip the order of two experts.
    same = (experts.sort(dim=-1).values == hf_experts.sort(dim=-1).values).all(dim=-1)
    assert same.float().mean() > (0.97 if dtype == torch.bfloat16 else 0.99), same.float().mean()
    assert (experts.unique() == torch.arange(4)).all(), "degenerate test: some expert is never chosen"
    order = lambda e, w: w.gather(1, e.argsort(dim=-1))  # weights in expert order, comparable across ties
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(order(experts, weights)[same].float(), order(hf_experts, hf_weights)[same].float(),
                               **tol)


def test_decode_reads_only_selected_experts(converted):
    """At batch 1 a NaN planted in an unselected expert must not reach the output."""
    _, path = converted("mixtral")
    model = load_model(path)
    moe = model.layers[0].feed_forward
    x = torch.randn(1, 1, model.config.dim)
    _, experts = moe.route(x.reshape(1, -1))
    unused = sorted(set(range(4)) - set(experts[0].tolist()))
    with torch.no_grad():
        expected = moe(x)
        for w in (moe.w1, moe.w2, moe.w3):
            w[unused] = float("nan")
        torch.testing.assert_close(moe(x), expected)


def test_batched_decode_equals_single(converted):
    _, path = converted("mixtral")
    model = load_model(path)
    prompts = torch.randint(0, 256, (3, 5), generator=torch.Generator().manual_seed(3))
    batched = generate(model, prompts, 12, temperature=0.0)
    for row, prompt in zip(batched, prompts):
        assert row.tolist() == generate(model, prompt, 12, temperature=0.0)[0].tolist()


@pytest.mark.parametrize("tokens", [1, 2, 5])
def test_compiled_moe_equals_eager(tokens, converted):
    # Compiled, 1-2 tokens x top-2 <= 4 experts gather the selected experts; 5 tokens run all experts.
    import torch._dynamo
    _, path = converted("mixtral")
    moe = load_model(path).layers[0].feed_forward
    x = torch.randn(1, tokens, moe.w1.shape[-1], generator=torch.Generator().manual_seed(tokens))
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(moe, fullgraph=True)(x), moe(x), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_compiled_decode_no_graph_breaks(converted):
    import torch._dynamo
    from decode import decode_one_token
    _, path = converted("mixtral")
    model = load_model(path)
    prompt = torch.tensor([9, 8, 7, 6, 5])
    eager = generate(model, prompt, 10, temperature=0.0)
    torch._dynamo.reset()
    decode_fn = torch.compile(decode_one_token, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = generate(model, prompt, 10, temperature=0.0, decode_fn=decode_fn)
    assert compiled.tolist() == eager.tolist()
