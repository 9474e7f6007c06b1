"""model/kernels.py: our AVX-512 decode attention over MLA latents and few-row linear layers against PyTorch's
kernels."""

import pytest
import torch
import torch.nn.functional as F

from seekforge.config import preset
from seekforge.model import kernels
from seekforge.model.model import build_model

pytestmark = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512" or not kernels.build(),
                                reason="the kernels need an AVX-512 CPU and a C++ toolchain")


def reference(q, latents, lengths, scale, value_dim):
    """fp32 softmax attention of q (B, M, D) over each sequence's first lengths[b] latents (B, S, D)."""
    keep = None if lengths is None else (torch.arange(latents.shape[1]) < lengths[:, None])[:, None, None, :]
    q, latents = q.float()[:, None], latents.float()[:, None]
    return F.scaled_dot_product_attention(q, latents, latents, attn_mask=keep, scale=scale)[:, 0, :, :value_dim]


@pytest.mark.parametrize("rows, seq, width, value_dim",
                         [(8, 192, 576, 512), (3, 37, 160, 128), (11, 1, 40, 32), (5, 9, 40, 24)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_latent_attention_equals_softmax_attention(rows, seq, width, value_dim, dtype, tol):
    """Query rows in blocks of 8 and a remainder, latent rows in pairs and an odd one, per-sequence lengths,
    strided latents (a view of wider dense rows, as serving's are)."""
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(5, seq + 7, width, generator=gen).to(dtype)[:, :seq]
    q = torch.randn(5, rows, width, generator=gen).to(dtype)
    q_view = torch.randn(rows, 5, width, generator=gen).to(dtype).transpose(0, 1)  # read in place, not copied
    for lengths in (None, torch.randint(1, seq + 1, (5,), generator=gen)):
        for query in (q, q_view):
            out = torch.ops.seekforge.latent_attention(query, latents, lengths, 0.1, value_dim)
            assert out.dtype == dtype and out.shape == (5, rows, value_dim) and out.is_contiguous()
            torch.testing.assert_close(out.float(), reference(query, latents, lengths, 0.1, value_dim), atol=tol,
                                       rtol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_latent_attention_splits_long_sequences_over_threads(dtype, tol):
    """Fewer sequences than threads: each sequence's latents in parts, merged by their softmax statistics; parts
    without rows (a sequence shorter than its parts) included."""
    gen = torch.Generator().manual_seed(3)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)  # 1 sequence: 3 parts of the 1,000 latents; 2: 2 parts each
    try:
        cases = [(1, None), (1, torch.tensor([700])), (1, torch.tensor([2])), (2, torch.tensor([1000, 2]))]
        for batch, lengths in cases:
            latents = torch.randn(batch, 1000, 160, generator=gen).to(dtype)
            q = torch.randn(batch, 8, 160, generator=gen).to(dtype)
            out = torch.ops.seekforge.latent_attention(q, latents, lengths, 0.1, 128)
            torch.testing.assert_close(out.float(), reference(q, latents, lengths, 0.1, 128), atol=tol, rtol=tol)
    finally:
        torch.set_num_threads(threads)


def test_latent_attention_compiles():
    """torch.compile traces it through its shape function and calls the kernel (serving's compiled decode)."""
    q, latents = torch.randn(4, 8, 160), torch.randn(4, 24, 160)
    lengths = torch.tensor([24, 3, 17, 9])
    def attend(q, x, n):
        return torch.ops.seekforge.latent_attention(q, x, n, 0.1, 128) * 2

    compiled = torch.compile(attend, fullgraph=True)
    torch.testing.assert_close(compiled(q, latents, lengths), 2 * reference(q, latents, lengths, 0.1, 128))


def test_absorbed_decode_attention_is_the_same_with_the_kernel(monkeypatch):
    """MLA.attend_absorbed over dense latent rows: the kernel against PyTorch's fused attention, which it replaces."""
    model = build_model(preset("tiny"), seed=0).eval()
    attn = model.layers[0].self_attn
    cfg, gen = model.cfg, torch.Generator().manual_seed(1)
    b, s = 6, 40
    q_nope = torch.randn(b, 1, cfg.num_attention_heads, cfg.qk_nope_head_dim, generator=gen)
    q_pe = torch.randn(b, 1, cfg.num_attention_heads, cfg.qk_rope_head_dim, generator=gen)
    latents = torch.randn(b, s, cfg.kv_lora_rank + cfg.qk_rope_head_dim, generator=gen)
    c_kv, k_pe = latents[..., :cfg.kv_lora_rank], latents[..., cfg.kv_lora_rank:]
    mask = (torch.arange(s) < torch.tensor([40, 1, 7, 33, 20, 39])[:, None])[:, None, None, :]
    outs = {}
    for ready in (True, False):
        monkeypatch.setattr(kernels, "_loaded", ready)
        with torch.no_grad():
            outs[ready] = attn.attend_absorbed(q_nope, q_pe, c_kv, k_pe, mask=mask, latents=latents)
    torch.testing.assert_close(outs[True], outs[False], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows, n, k", [(1, 512, 512), (1, 33, 40), (2, 5, 17), (3, 64, 100), (4, 7, 64), (9, 20, 48)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_linear_rows_equals_linear(rows, n, k, dtype, tol):
    """Widths with and without a 64-column body and a masked tail, one to four query rows and more (passes of
    four), a bias, leading dims and query rows that are a strided view."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 2 * k, generator=gen).to(dtype)[:, ::2]
    weight, bias = torch.randn(n, k, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)
    want = F.linear(x.double(), weight.double(), bias.double())
    for b in (None, bias):
        out = torch.ops.seekforge.linear_rows(x[None], weight, b)
        assert out.dtype == dtype and out.shape == (1, rows, n)
        torch.testing.assert_close(out[0].double(), want if b is not None else want - bias.double(), atol=tol, rtol=tol)


def test_linear_takes_few_row_inference_only(monkeypatch):
    """kernels.Linear: the kernel for inference over at most MAX_LINEAR_ROWS rows of a plain fp32/bf16 weight,
    nn.Linear's F.linear otherwise (training: the kernel has no backward)."""
    monkeypatch.setattr(kernels, "_loaded", True)
    layer = kernels.Linear(48, 24)
    calls = []
    monkeypatch.setattr(torch.ops.seekforge, "linear_rows", lambda *a: calls.append(a) or F.linear(*a))
    x = torch.randn(1, 1, 48)
    with torch.no_grad():
        layer(x), layer(x.repeat(1, kernels.MAX_LINEAR_ROWS, 1))
        assert len(calls) == 2
        layer(x.repeat(1, kernels.MAX_LINEAR_ROWS + 1, 1)), kernels.Linear(48, 24).double()(x.double())
        assert len(calls) == 2  # too many rows; another dtype
        assert not kernels.linear_takes(x.bfloat16(), layer.weight)  # x's dtype not the weight's
    layer(x).sum().backward()
    assert len(calls) == 2 and layer.weight.grad is not None


def test_linear_rows_compiles_for_static_rows_only(monkeypatch):
    """Traced with one row it is in the graph; with a dynamic row count (serving's batched programs serve every
    batch size), even one within MAX_LINEAR_ROWS, F.linear is."""
    import torch._dynamo.testing

    monkeypatch.setattr(kernels, "_loaded", True)
    weight = torch.randn(24, 48)
    for dynamic, in_graph in ((False, True), (True, False)):
        counter = torch._dynamo.testing.EagerAndRecordGraphs()
        compiled = torch.compile(lambda x: kernels.linear(x, weight), backend=counter, fullgraph=True, dynamic=dynamic)
        with torch.no_grad():
            x = torch.randn(1, 48) if not dynamic else torch.randn(3, 48)
            torch.testing.assert_close(compiled(x), F.linear(x, weight), atol=1e-5, rtol=1e-5)
        graph = str(counter.graphs[0].graph)
        assert ("linear_rows" in graph) == in_graph, graph


def test_one_token_experts_are_the_same_with_the_kernel(monkeypatch):
    """A MoE layer's batch-1 path (GroupedExperts.forward_one_token) with the kernel and with torch.mm."""
    model = build_model(preset("tiny"), seed=0).eval()
    moe = next(layer.mlp for layer in model.layers if hasattr(layer.mlp, "experts"))
    x = torch.randn(1, 1, model.cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    outs = {}
    for ready in (True, False):
        monkeypatch.setattr(kernels, "_loaded", ready)
        with torch.no_grad():
            outs[ready] = moe(x)
    torch.testing.assert_close(outs[True], outs[False], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 6])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_grouped_products_equal_bmm(rows, dtype, tol, monkeypatch):
    """The absorbed attention's two products (kernels.bmm, kernels.bmm_t) over per-head views with gaps between
    the heads, as MLA.kv_b_weights splits them: widths past a 64/128-column chunk, masked tails; the query rows
    contiguous or, as a decode step's heads are, a transposed view (read in place)."""
    gen = torch.Generator().manual_seed(0)
    heads, dn, dv, r = 3, 40, 24, 150
    kv_b = torch.randn(heads, dn + dv, r, generator=gen).to(dtype)
    w_uk, w_uv = kv_b.split([dn, dv], dim=1)
    q_rows = torch.randn(heads, rows, dn, generator=gen).to(dtype)
    latent_rows = torch.randn(heads, rows, r, generator=gen).to(dtype)
    monkeypatch.setattr(kernels, "_loaded", True)
    for q, latent in ((q_rows, latent_rows), (q_rows.transpose(0, 1).contiguous().transpose(0, 1),
                                              latent_rows.transpose(0, 1).contiguous().transpose(0, 1))):
        with torch.no_grad():
            got_k, got_v = kernels.bmm(q, w_uk), kernels.bmm_t(latent, w_uv)
            assert kernels.linear_takes(q, w_uk, grouped=True) == (rows <= kernels.MAX_LINEAR_ROWS)
        torch.testing.assert_close(got_k.double(), torch.bmm(q.double(), w_uk.double()), atol=tol, rtol=tol)
        torch.testing.assert_close(got_v.double(), torch.bmm(latent.double(), w_uv.double().transpose(1, 2)),
                                   atol=tol, rtol=tol)


@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_indexed_products_equal_bmm_of_the_chosen_weights(rows, dtype, tol, monkeypatch):
    """kernels.linear_indexed: G query groups, each against the weight its id picks from a stack (a token's chosen
    experts, an id twice among them), read in place; an id outside the stack is an error, not a read past it."""
    gen = torch.Generator().manual_seed(0)
    stack = torch.randn(6, 40, 70, generator=gen).to(dtype)
    x_rows = torch.randn(4, rows, 70, generator=gen).to(dtype)
    ids = torch.tensor([5, 0, 3, 5])
    monkeypatch.setattr(kernels, "_loaded", True)
    # the rows as given, and one token's rows repeated for each expert (a broadcast view, as moe.py passes them)
    for x in (x_rows, x_rows[:1].expand(4, rows, 70)):
        with torch.no_grad():
            got = kernels.linear_indexed(x, stack, ids)
        torch.testing.assert_close(got.double(), torch.bmm(x.double(), stack[ids].double().transpose(1, 2)),
                                   atol=tol, rtol=tol)
    with pytest.raises(RuntimeError, match="index 6 outside the 6 weights"):
        torch.ops.seekforge.linear_rows_indexed(x, stack, torch.tensor([5, 0, 6, 1]))


@pytest.mark.skipif(not kernels.cpu_kernels_wanted(),
                    reason="the product loads the kernels only where this CPU wants them (AVX-512 without AMX)")
def test_compiled_code_calls_the_kernels_through_their_c_shims():
    """Code inductor generates with cpp_wrapper and c_shims() calls each kernel's C entry point (csrc/c_shims.h),
    arguments in schema order, None for an absent optional tensor: the same results as the ops called eagerly.
    The table pickles as its ops' names (inductor's compiled-graph cache key holds it)."""
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_cpp_code

    assert kernels.load()
    shims = kernels.c_shims()
    assert {str(op) for op in shims} == {f"seekforge.{name}.default" for name in
                                         ("linear_rows", "rows_times", "linear_rows_indexed", "latent_attention")}
    assert shims.__reduce__() == (dict, ({str(op): declaration for op, declaration in shims.items()},))
    ops = torch.ops.seekforge

    def step(x, w, b, stack, index, latents, lengths):
        h = ops.linear_rows(x, w, None) + ops.linear_rows(x, w, b)  # (1, K)
        experts = ops.linear_rows_indexed(h.expand(2, 1, -1).contiguous(), stack, index)  # (2, 1, K)
        keys = ops.rows_times(experts, stack[:2].transpose(1, 2).contiguous())  # (2, 1, K)
        return (ops.latent_attention(keys, latents, None, 0.5, 16) + ops.latent_attention(keys, latents, lengths, 0.5,
                                                                                          16))
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(*shape, generator=gen).to(torch.bfloat16) for shape in ((1, 64), (64, 64), (64,), (4, 64, 64))]
    args += [torch.tensor([3, 1]), torch.randn(2, 9, 64, generator=gen).to(torch.bfloat16), torch.tensor([4, 9])]
    with torch.inference_mode():
        expected = step(*args)
        with config.patch({"cpp_wrapper": True, "aot_inductor.custom_ops_to_c_shims": shims, "fx_graph_cache": False}):
            out, code = run_and_get_cpp_code(torch.compile(step, fullgraph=True), *args)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    assert "aoti_torch_cpu_linear_rows(" in code and "aoti_torch_call_dispatcher" not in code
