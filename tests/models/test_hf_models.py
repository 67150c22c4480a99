"""Models nobody here wrote: small random-init transformers models, through `fusec.compile(model)`
unchanged, compared with eager.

Each model is built from a config (no weights are downloaded), tiny (hidden 32, 2 layers, 8
tokens or 32x32 images), in float32. A compiled model must return what eager returns: the same
type (`CausalLMOutputWithPast` ...), the same structure (a `DynamicCache` with its layers), and
every tensor within a relative error of 1e-5 of eager's, with its kernels in `cf.kernels`.
"""
import copy

import pytest
import torch

import fusec
from fusec.record import record_of
from conftest import TRITON_DEVICE
from fusec.outputs import flatten

transformers = pytest.importorskip("transformers")

TOKENS = (2, 8)
IMAGE = (2, 3, 32, 32)


def gpt2():
    config = transformers.GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config), "tokens"


def llama():
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=16,
                                      bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(config), "tokens"


def t5_encoder():
    config = transformers.T5Config(vocab_size=96, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                                   num_heads=2)
    return transformers.T5EncoderModel(config), "tokens"


def bert():
    config = transformers.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=16)
    return transformers.BertModel(config), "tokens"


def vit():
    config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32,
                                    num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=64)
    return transformers.ViTModel(config), "image"


def resnet():
    config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1])
    return transformers.ResNetModel(config), "image"


def convnext():
    config = transformers.ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2)
    return transformers.ConvNextModel(config), "image"


def bloom():
    # its GELU is a custom autograd.Function written the old way (GeLUFunction.apply), which
    # torch refuses inside capture's functionalize; fusec traces its forward
    config = transformers.BloomConfig(vocab_size=96, hidden_size=32, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0)
    return transformers.BloomForCausalLM(config), "tokens"


DECODER = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
               bos_token_id=0, eos_token_id=0)


def mistral():  # grouped-query attention with a sliding window
    return transformers.MistralForCausalLM(transformers.MistralConfig(**DECODER)), "tokens"


def phi():  # rotary embeddings over part of each head, a parallel attention + MLP block
    return transformers.PhiForCausalLM(transformers.PhiConfig(**DECODER)), "tokens"


def deberta_v2():  # disentangled attention: relative positions gathered per head
    config = transformers.DebertaV2Config(vocab_size=96, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=4, intermediate_size=64,
                                          max_position_embeddings=16)
    return transformers.DebertaV2Model(config), "tokens"


def swin():  # shifted windows: roll, window partition views, a relative position bias
    config = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                                     num_heads=[2, 2], window_size=4)
    return transformers.SwinModel(config), "image"


def segformer():  # overlapping patch convolutions, attention over a reduced sequence
    config = transformers.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                                          hidden_sizes=[16, 32], num_attention_heads=[1, 2],
                                          patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2])
    return transformers.SegformerModel(config), "image"


MODELS = {f.__name__: f for f in (gpt2, llama, t5_encoder, bert, vit, resnet, convnext, bloom,
                                  mistral, phi, deberta_v2, swin, segformer)}


def qwen2():  # biases on the query, key and value projections (the one-token test only)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**DECODER)), "tokens"


def build(name: str, device: str = "cpu"):
    torch.manual_seed(0)
    model, kind = (MODELS.get(name) or {"qwen2": qwen2}[name])()
    model = model.to(device).eval()
    if kind == "tokens":
        example = torch.randint(0, 96, TOKENS, device=device)
    else:
        example = torch.randn(IMAGE, device=device)
    return model, example


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (0 when both are all zeros)."""
    scale = want.abs().max().item() if want.numel() else 0.0
    err = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
    return err / scale if scale else err


def assert_same_output(got, want, rtol: float = 1e-5) -> None:
    """Same type, same structure (pytree spec, with fusec's view of unregistered objects), and
    every tensor within `rtol` of eager's (relative to the tensor's largest magnitude)."""
    assert type(got) is type(want), (type(got), type(want))
    got_leaves, got_spec = flatten(got)
    want_leaves, want_spec = flatten(want)
    assert got_spec == want_spec, f"\n{got_spec}\n!=\n{want_spec}"
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        if not isinstance(w, torch.Tensor):
            assert g == w, (i, g, w)
            continue
        assert isinstance(g, torch.Tensor) and g.shape == w.shape and g.dtype == w.dtype, i
        assert relative_error(g.cpu(), w.cpu()) <= rtol, (i, relative_error(g.cpu(), w.cpu()))


# every model on the C++ backend and on the LLVM one; two of them on Triton too (its interpreter,
# on a machine without a GPU, runs each kernel in numpy: slow, so only the smallest)
CASES = [(name, "cpp") for name in MODELS] + [(name, "llvm") for name in MODELS] + \
    [("bert", "triton"), ("resnet", "triton")]


@pytest.mark.parametrize("name,backend", CASES, ids=[f"{n}-{b}" for n, b in CASES])
def test_model_matches_eager(name, backend):
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    model, example = build(name, device)
    compiled = fusec.compile(model, backend=backend)
    with torch.no_grad():
        want = model(example)
        got = compiled(example)
    assert_same_output(got, want)
    assert compiled.kernels, "no kernel was generated"
    assert all(k.backend == backend for k in compiled.kernels)
    with torch.no_grad():  # the second call takes the fast path: the same answer
        again = compiled(example)
    assert_same_output(again, want)


def test_llama_returns_its_cache_as_eager_does():
    """LlamaForCausalLM returns a DynamicCache by default (use_cache=True): one a later call can
    be given back, holding this call's keys and values, new objects on every call."""
    model, ids = build("llama")
    compiled = fusec.compile(model, backend="cpp")
    with torch.no_grad():
        want, got, again = model(ids), compiled(ids), compiled(ids)
    cache = got.past_key_values
    assert type(cache) is transformers.DynamicCache
    assert cache.get_seq_length() == want.past_key_values.get_seq_length() == TOKENS[1]
    for layer, eager_layer in zip(cache.layers, want.past_key_values.layers):
        assert relative_error(layer.keys, eager_layer.keys) <= 1e-5
        assert relative_error(layer.values, eager_layer.values) <= 1e-5
    assert again.past_key_values is not cache
    assert again.past_key_values.layers[0].keys is not cache.layers[0].keys
    # the cache works as eager's does: the next token reads it
    nxt = ids[:, -1:]
    with torch.no_grad():
        step = model(nxt, past_key_values=cache, use_cache=True)
        ref = model(nxt, past_key_values=want.past_key_values, use_cache=True)
    assert relative_error(step.logits, ref.logits) <= 1e-5


def test_gpt2_ties_its_head_to_its_embedding():
    model, ids = build("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    compiled = fusec.compile(model, backend="cpp")
    with torch.no_grad():
        compiled(ids)
    lifted = compiled._compiled.last.captured.lifted_names
    assert "transformer.wte.weight" in lifted and "lm_head.weight" not in lifted


def test_training_step_matches_eager():
    """forward + backward + an optimizer step through GPT-2 (whose head is tied to its
    embedding: the tied weight's gradient sums both uses), against the same steps in eager."""
    model, ids = build("gpt2")
    model.train()
    model.config.attn_pdrop = model.config.resid_pdrop = model.config.embd_pdrop = 0.0
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    ref = copy.deepcopy(model)
    compiled = fusec.compile(model, backend="cpp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        loss = compiled(ids, labels=ids).loss
        ref_loss = ref(ids, labels=ids).loss
        loss.backward()
        ref_loss.backward()
        assert relative_error(loss.detach(), ref_loss.detach()) <= 1e-5, step
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            assert relative_error(p.grad, r.grad) <= 1e-4, (step, name)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert compiled.kernels
    for p, r in zip(model.parameters(), ref.parameters()):
        assert relative_error(p.detach(), r.detach()) <= 1e-5


@pytest.mark.parametrize("backend", ["cpp", "llvm"])
def test_bert_with_padding_mask_is_one_graph(backend):
    """transformers checks `padding_mask.all()` in Python unless torch.compiler.is_compiling()
    says a compiler is tracing; fusec's capture says so, so BERT with a padding mask is one graph
    (fullgraph=True), and the mask's values still matter on every call."""
    model, ids = build("bert")
    compiled = fusec.compile(model, backend=backend, fullgraph=True)
    padded = torch.ones(TOKENS, dtype=torch.long)
    padded[1, 5:] = 0
    for mask in (padded, torch.ones(TOKENS, dtype=torch.long), padded.flip(1)):
        with torch.no_grad():
            want = model(ids, attention_mask=mask)
            got = compiled(ids, attention_mask=mask)
        assert_same_output(got, want)
    assert compiled._compiled.breaks is None
    assert not torch.compiler.is_compiling()  # only while capturing


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: SDPA's kernel choice is CUDA's")
def test_bert_without_a_mask_keeps_fused_attention_on_a_gpu():
    """Inside a compile transformers' BERT builds an all-ones mask expanded along the keys
    (stride 0); SDPA sends such a mask to math attention (float32 matmuls). fusec's capture makes
    the mask dense first (frontend.dense_attention_masks), so a fused attention op is captured
    and no batched matmul is left."""
    from fusec.frontend import capture
    model, ids = build("bert")
    model = model.cuda().to(torch.bfloat16)
    ids = ids.cuda()
    targets = {str(n.target) for n in capture(model, (ids,)).gm.graph.nodes}
    assert any("_scaled_dot_product" in t and "attention" in t for t in targets), targets
    assert "aten.bmm.default" not in targets
    compiled = fusec.compile(model)
    with torch.no_grad():
        want, got = model(ids), compiled(ids)
    torch.testing.assert_close(got.last_hidden_state.float(), want.last_hidden_state.float(),
                               atol=5e-2, rtol=5e-2)


def test_cpu_attention_masks_are_left_as_they_are():
    """The dense-mask rewrite is for CUDA only: the CPU flash attention reads a broadcast mask."""
    import torch.nn.functional as F
    from fusec.frontend import capture

    def f(q, m):
        return F.scaled_dot_product_attention(q, q, q, attn_mask=m.expand(2, 1, 8, 8))

    gm = capture(f, (torch.randn(2, 3, 8, 4), torch.ones(2, 1, 1, 1, dtype=torch.bool))).gm
    assert "aten.clone.default" not in {str(n.target) for n in gm.graph.nodes}
    q, m = torch.randn(2, 3, 8, 4), torch.ones(2, 1, 1, 1, dtype=torch.bool)
    torch.testing.assert_close(fusec.compile(f, backend="cpp")(q, m), f(q, m), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2"])
def test_one_token_bf16_step_runs_its_linears_as_gemvs(monkeypatch, name):
    """A decode step of a model nobody here wrote: one token, batch 1, bf16. On a GPU every
    stored-weight linear at M = 1 becomes fusec's GEMV (passes/small_matmul.py,
    STORED_GEMV_DEVICES); the list is widened here so that the Triton interpreter runs the same
    kernels on a machine without a GPU. The logits match eager's within bf16 rounding."""
    small_matmul = __import__("fusec.extensions.quant_gemv.small_matmul", fromlist=["STORED_GEMV_DEVICES"])
    monkeypatch.setattr(small_matmul, "STORED_GEMV_DEVICES", ("cuda", TRITON_DEVICE))
    model, ids = build(name, TRITON_DEVICE)
    model = model.to(torch.bfloat16)
    ids = ids[:1, :1]
    compiled = fusec.compile(model, backend="triton")
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        got = compiled(ids, use_cache=False).logits
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert relative_error(got.float(), want.float()) <= 2e-2
    gemvs = [k.name for k in compiled.kernels if "gemv" in k.name]
    assert len(gemvs) >= 4, [k.name for k in compiled.kernels]
    if name != "gpt2":  # q/k/v and gate/up read one input each: joined (passes/sibling_gemvs.py)
        last = compiled._compiled.last if hasattr(compiled, "_compiled") else compiled.last
        joined = [d for d in record_of(last.gm).extensions["sibling_gemvs"] if d.taken]
        assert len(joined) >= 5, record_of(last.gm).extensions["sibling_gemvs"]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_generate_through_a_compiled_forward(name):
    """The way people speed up `model.generate`: `model.forward = fusec.compile(model.forward)`.
    generate passes its DynamicCache back in on every step and the forward fills it; one graph
    cannot (capture traces on a copy of the cache and sees the program put tensors into it), so
    fusec compiles the forward in regions through Dynamo, and the greedy tokens are eager's."""
    model, ids = build(name)
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=6, do_sample=False)
    compiled = copy.deepcopy(model)
    compiled.forward = fusec.compile(compiled.forward, backend="cpp")
    with torch.no_grad(), pytest.warns(UserWarning, match="puts tensors into an argument DynamicCache"):
        got = compiled.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    assert compiled.forward.kernels, "the regions were compiled by fusec"
