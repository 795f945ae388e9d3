"""flash_attn.bert_padding on the CPU: the flash_attn 2.x padding utilities that HF transformers
imports. Round trips, hand-computed cu_seqlens / indices (with an empty sequence), gradients in
float64, and tracing under torch.compile."""

import zlib

import pytest
import torch

from flash_attn.bert_padding import (
    index_first_axis,
    index_put_first_axis,
    pad_input,
    unpad_input,
    unpad_input_for_concatenated_sequences,
)

f64 = torch.float64
i32, i64 = torch.int32, torch.int64

# Row 1 is an empty sequence, row 2 a full one.
MASK = torch.tensor([[1, 1, 1, 0, 0],
                     [0, 0, 0, 0, 0],
                     [1, 1, 1, 1, 1],
                     [1, 0, 0, 0, 0]])
MASK_INDICES = [0, 1, 2, 10, 11, 12, 13, 14, 15]
MASK_CU_SEQLENS = [0, 3, 3, 8, 9]


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh data per test, reproducible from the test id."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _random_mask(batch, seqlen):
    """Right-padded rows of random lengths, one of them empty and one full."""
    lengths = torch.randint(0, seqlen + 1, (batch,))
    lengths[0], lengths[-1] = 0, seqlen
    return torch.arange(seqlen) < lengths.unsqueeze(1)


def test_hf_transformers_import():
    from flash_attn.bert_padding import index_first_axis, pad_input, unpad_input  # noqa: F401


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.int32])
def test_unpad_hand_made_mask(dtype):
    x = torch.randn(4, 5, 3, 7)
    hidden, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, MASK.to(dtype))
    assert indices.dtype == i64 and indices.tolist() == MASK_INDICES
    assert cu_seqlens.dtype == i32 and cu_seqlens.tolist() == MASK_CU_SEQLENS
    assert isinstance(max_seqlen, int) and max_seqlen == 5
    assert seqused.dtype == i32 and seqused.tolist() == [3, 0, 5, 1]
    assert torch.equal(hidden, x.reshape(20, 3, 7)[MASK_INDICES])


def test_unpad_unused_mask():
    """unused positions are packed (cu_seqlens, indices) but not counted in seqused."""
    attention_mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    unused_mask = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    x = torch.randn(3, 4, 2)
    hidden, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, attention_mask, unused_mask)
    assert indices.tolist() == [0, 1, 2, 4, 5, 6]
    assert cu_seqlens.tolist() == [0, 3, 6, 6] and max_seqlen == 3
    assert seqused.tolist() == [2, 1, 0]
    assert torch.equal(hidden, x.reshape(12, 2)[[0, 1, 2, 4, 5, 6]])


def test_unpad_without_unused_mask_seqused_is_the_lengths():
    mask = _random_mask(6, 33)
    _, _, cu_seqlens, max_seqlen, seqused = unpad_input(torch.randn(6, 33, 4), mask)
    assert torch.equal(cu_seqlens.diff(), seqused)
    assert max_seqlen == int(mask.sum(-1).max()) == 33


@pytest.mark.parametrize("shape", [(5, 17), (5, 17, 3), (3, 64, 6, 40)])
def test_pad_unpad_round_trip(shape):
    x = torch.randn(shape)
    mask = _random_mask(*shape[:2])
    hidden, indices, _, _, _ = unpad_input(x, mask)
    assert hidden.shape == (int(mask.sum()), *shape[2:])
    back = pad_input(hidden, indices, *shape[:2])
    expected = x * mask.view(*shape[:2], *[1] * (len(shape) - 2))
    assert back.shape == x.shape and torch.equal(back, expected)


def test_round_trip_mask_with_holes():
    """Nothing requires right padding: any mask packs and unpacks."""
    x = torch.randn(4, 9, 5)
    mask = torch.rand(4, 9) < 0.5
    hidden, indices, cu_seqlens, _, _ = unpad_input(x, mask)
    assert torch.equal(hidden, x[mask])          # boolean indexing is batch-major too
    assert cu_seqlens[-1] == mask.sum()
    assert torch.equal(pad_input(hidden, indices, 4, 9), x * mask.unsqueeze(-1))


def test_empty_batch_and_all_padding():
    for x, mask in [(torch.randn(0, 8, 3), torch.zeros(0, 8, dtype=torch.bool)),
                    (torch.randn(3, 8, 3), torch.zeros(3, 8, dtype=torch.bool))]:
        hidden, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask)
        assert hidden.shape == (0, 3) and indices.numel() == 0 and max_seqlen == 0
        assert cu_seqlens.tolist() == [0] * (x.shape[0] + 1)
        assert seqused.tolist() == [0] * x.shape[0]
        assert torch.equal(pad_input(hidden, indices, *x.shape[:2]), torch.zeros_like(x))


@pytest.mark.parametrize("index_dtype", [i64, i32])
def test_index_put_first_axis_inverts_index_first_axis(index_dtype):
    n = 23
    indices = torch.randperm(n)[:11].to(index_dtype)
    values = torch.randn(11, 4, 3)
    scattered = index_put_first_axis(values, indices, n)
    assert scattered.shape == (n, 4, 3) and scattered.dtype == values.dtype
    assert torch.equal(index_first_axis(scattered, indices), values)
    rest = torch.ones(n, dtype=torch.bool)
    rest[indices.long()] = False
    assert torch.equal(scattered[rest], torch.zeros(n - 11, 4, 3))
    x = torch.randn(n, 4, 3)
    rows = index_first_axis(x, indices)
    assert torch.equal(rows, x[indices.long()])
    assert torch.equal(index_first_axis(index_put_first_axis(rows, indices, n), indices), rows)


def test_index_first_axis_gradient_scatters_back():
    x = torch.randn(10, 3, requires_grad=True)
    indices = torch.tensor([7, 2, 5])
    grad_rows = torch.randn(3, 3)
    (grad_x,) = torch.autograd.grad(index_first_axis(x, indices), x, grad_rows)
    expected = torch.zeros(10, 3)
    expected[indices] = grad_rows
    assert torch.equal(grad_x, expected)


def test_gradcheck():
    x = torch.randn(3, 6, 2, dtype=f64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    indices = torch.nonzero(mask.flatten()).flatten()
    rows = torch.randn(len(indices), 2, dtype=f64, requires_grad=True)
    flat = x.detach().reshape(18, 2).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: index_first_axis(t, indices), (flat,))
    assert torch.autograd.gradcheck(lambda t: index_put_first_axis(t, indices, 18), (rows,))
    assert torch.autograd.gradcheck(lambda t: pad_input(t, indices, 3, 6), (rows,))
    assert torch.autograd.gradcheck(lambda t: unpad_input(t, mask)[0], (x,))
    lengths = torch.tensor([[2, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    assert torch.autograd.gradcheck(
        lambda t: unpad_input_for_concatenated_sequences(t, lengths)[0], (x,))


def test_unpad_pad_gradient_is_the_mask():
    x = torch.randn(4, 5, 3, requires_grad=True)
    hidden, indices, _, _, _ = unpad_input(x, MASK)
    pad_input(hidden, indices, 4, 5).sum().backward()
    assert torch.equal(x.grad, MASK.unsqueeze(-1).expand(4, 5, 3).float())


def test_concatenated_sequences_hand_made():
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0],
                            [0, 0, 0, 0, 0, 0],
                            [3, 2, 1, 0, 0, 0],
                            [4, 0, 1, 0, 0, 0]])          # a zero between lengths is skipped
    x = torch.randn(4, 6, 2, 3)
    hidden, indices, cu_seqlens, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths)
    expected_indices = [0, 1, 2, 3, 4, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    assert indices.dtype == i64 and indices.tolist() == expected_indices
    assert cu_seqlens.dtype == i32 and cu_seqlens.tolist() == [0, 2, 5, 8, 10, 11, 15, 16]
    assert isinstance(max_seqlen, int) and max_seqlen == 4
    assert torch.equal(hidden, x.reshape(24, 2, 3)[expected_indices])
    assert torch.equal(pad_input(hidden, indices, 4, 6),
                       x * (lengths.sum(-1, keepdim=True) > torch.arange(6))[..., None, None])


def test_concatenated_sequences_match_unpad_for_one_sequence_per_row():
    mask = _random_mask(5, 12)
    x = torch.randn(5, 12, 4)
    lengths = torch.zeros(5, 12, dtype=i32)
    lengths[:, 0] = mask.sum(-1)
    got = unpad_input_for_concatenated_sequences(x, lengths)
    hidden, indices, cu_seqlens, max_seqlen, _ = unpad_input(x, mask)
    assert torch.equal(got[0], hidden) and torch.equal(got[1], indices)
    # unpad_input keeps a segment for the empty row; here the empty row has no sequence.
    assert got[2].tolist() == sorted(set(cu_seqlens.tolist())) and got[3] == max_seqlen


def test_concatenated_sequences_too_long():
    with pytest.raises(ValueError, match=r"attention_mask_in_length.*seqlen=4.*row sum of 5"):
        unpad_input_for_concatenated_sequences(torch.randn(1, 4, 2), torch.tensor([[3, 2, 0, 0]]))
    with pytest.raises(ValueError, match=r"smallest entry of -1"):
        unpad_input_for_concatenated_sequences(torch.randn(1, 4, 2), torch.tensor([[3, -1, 0, 0]]))


def test_mask_shape_is_checked():
    with pytest.raises(ValueError, match=r"attention_mask must have shape .* \(2, 5\).*\(2, 4\)"):
        unpad_input(torch.randn(2, 5, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"unused_mask"):
        unpad_input(torch.randn(2, 5, 3), torch.ones(2, 5), torch.zeros(5, 2))


def test_torch_compile_traces_the_index_functions():
    """index_first_axis / pad_input compile into one graph (no graph break) with dynamic
    token counts; aot_eager traces forward and backward without needing a C++ compiler."""
    torch._dynamo.reset()

    def unpad_then_pad(x, indices):
        b, s = x.shape[:2]
        rows = index_first_axis(x.reshape(b * s, *x.shape[2:]), indices)
        return pad_input(rows * 2, indices, b, s)

    compiled = torch.compile(unpad_then_pad, backend="aot_eager", fullgraph=True, dynamic=True)
    for batch, seqlen in [(3, 8), (4, 16)]:
        x = torch.randn(batch, seqlen, 5, requires_grad=True)
        mask = _random_mask(batch, seqlen)
        indices = torch.nonzero(mask.flatten()).flatten()
        out = compiled(x, indices)
        assert torch.equal(out, unpad_then_pad(x, indices))
        out.sum().backward()
        assert torch.equal(x.grad, 2 * mask.unsqueeze(-1).expand_as(x).float())
