"""A real client: HF transformers' Llama with ``attn_implementation="flash_attention_2"`` on a
padded batch (which transformers runs through flash_attn_varlen_func) against the same model on
its ``sdpa`` path, logits and gradients. transformers is not a dependency: the test skips
without it, and until a family has variable-length kernels. transformers finds flash_attn by
its installed distribution (flash-attn's metadata): an in-place build has none, and the test
skips with that reason (.ci/gpu gives its build one).
"""

import importlib.metadata

import pytest
import torch

import flash_attn
from flash_attn import build_matrix
from conftest import requires_gpu

pytestmark = requires_gpu

transformers = pytest.importorskip("transformers")


def _varlen_family():
    """The family automatic dispatch gives a padded batch that needs a gradient, if it can run
    one: the preferred family here, with variable-length forward and backward kernels."""
    families = flash_attn.available_backends()
    if not families:
        return None
    name = families[0]
    owners = (name, build_matrix.backward_family(name, 64, {"varlen"}))
    return name if all("varlen" in build_matrix.FAMILIES[f].features for f in owners) else None


def _flash_attn_distribution():
    """Whether an installed flash-attn distribution provides the flash_attn package, as
    transformers' is_flash_attn_2_available checks it."""
    names = importlib.metadata.packages_distributions().get("flash_attn", [])
    return any(n.replace("_", "-").lower() == "flash-attn" for n in names)


def _model(attn_implementation):
    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
        attn_implementation=attn_implementation)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16)


def test_llama_padded_batch_matches_sdpa():
    if _varlen_family() is None:
        pytest.skip("no family in this version has variable-length kernels")
    if not _flash_attn_distribution():
        pytest.skip("transformers finds flash_attn by its installed metadata, which this one "
                    "lacks (an in-place build): pip install --no-build-isolation . to run it")
    lengths = [300, 17, 129, 256]
    batch, longest = len(lengths), max(lengths)
    input_ids = torch.randint(0, 1000, (batch, longest), device="cuda")
    # Left padding, as generation pads; the attention mask marks the real tokens.
    mask = torch.zeros(batch, longest, dtype=torch.long, device="cuda")
    for b, n in enumerate(lengths):
        mask[b, longest - n:] = 1
    # Labels on the real tokens but the first of each sequence: its prediction comes from the
    # padding before it, whose attention output the two paths define differently (SDPA lets a
    # padded row attend to every key; flash_attention_2 unpads it, so it is zero).
    labels = input_ids.masked_fill(mask == 0, -100)
    for b, n in enumerate(lengths):
        labels[b, longest - n] = -100
    results = {}
    for impl in ("sdpa", "flash_attention_2"):
        model = _model(impl)
        out = model(input_ids=input_ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        results[impl] = (out.logits.float(), out.loss.float(), grads)
    logits_ref, loss_ref, grads_ref = results["sdpa"]
    logits, loss, grads = results["flash_attention_2"]
    real = mask.bool()
    # bf16 end to end on both sides: agree to bf16's resolution over two layers.
    torch.testing.assert_close(logits[real], logits_ref[real], atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(loss, loss_ref, atol=1e-2, rtol=1e-2)
    for name, g in grads_ref.items():
        scale = g.abs().max().item() + 1e-6
        assert (grads[name] - g).abs().max().item() <= 5e-2 * scale, name
