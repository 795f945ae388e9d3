"""Padding utilities of the flash_attn 2.x API, in plain PyTorch: between padded batches
``(batch, seqlen, ...)`` and the packed ``(total_tokens, ...)`` layout of the varlen functions.

HF transformers imports ``index_first_axis``, ``pad_input`` and ``unpad_input`` from here when a
``flash-attn`` distribution is installed, so the names, signatures and return values are
flash_attn 2.x's (``unpad_input`` returns the 2.7+ 5-tuple).

Conventions:

- A padding mask is ``(batch, seqlen)``, bool or integer, nonzero for a real token.
- ``indices``: int64, the positions of the real tokens in the mask flattened to
  ``(batch * seqlen,)``, in increasing order; packed row ``i`` is padded position
  ``indices[i]``.
- ``cu_seqlens``: int32, ``(n_sequences + 1,)``, starts at 0; sequence ``j`` is packed rows
  ``cu_seqlens[j]:cu_seqlens[j + 1]``. An empty sequence gives two equal entries.
- ``max_seqlen_in_batch``: a Python int (0 for an empty batch).

Everything is differentiable through ordinary torch ops (``index_select``, ``index_put``):
gathering rows scatters their gradient back, and the reverse. ``index_first_axis``,
``index_put_first_axis`` and ``pad_input`` trace into one graph under ``torch.compile``; the
``unpad_*`` functions cannot, because the number of tokens and the returned ``int`` depend on
the mask's values (one device-to-host copy each).
"""

import torch
import torch.nn.functional as F

__all__ = [
    "index_first_axis",
    "index_put_first_axis",
    "pad_input",
    "unpad_input",
    "unpad_input_for_concatenated_sequences",
]


def index_first_axis(input, indices):
    """``input[indices]`` along the first axis: ``(n, ...)`` -> ``(len(indices), ...)``.

    The gradient is scattered back into the rows that were read (zeros elsewhere).
    ``indices`` is a 1-D int64 or int32 tensor."""
    return input.index_select(0, indices)


def index_put_first_axis(values, indices, first_axis_dim):
    """The inverse of ``index_first_axis``: a zero tensor ``(first_axis_dim, ...)`` whose rows
    ``indices`` are ``values`` (``(len(indices), ...)``). ``indices`` must not repeat.

    The gradient of ``values`` is the output gradient's rows ``indices``."""
    out = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return out.index_put((indices,), values)


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """Pack the real tokens of a padded batch.

    hidden_states: ``(batch, seqlen, ...)``.
    attention_mask: ``(batch, seqlen)``, bool or int, nonzero for a real token.
    unused_mask: optional ``(batch, seqlen)``, nonzero for a position that is packed (it is
        allocated, e.g. a slot to be filled later) but holds no real token.

    Returns ``(hidden_states, indices, cu_seqlens, max_seqlen_in_batch, seqused)``:

    - hidden_states: ``(total, ...)``, the rows of the packed positions, batch by batch;
    - indices: int64 ``(total,)``, their flattened positions (see the module docstring);
    - cu_seqlens: int32 ``(batch + 1,)``, cumulative per-sequence packed lengths, from 0;
    - max_seqlen_in_batch: int, the longest packed sequence;
    - seqused: int32 ``(batch,)``, each sequence's count of real tokens (``attention_mask``
      alone), for kernels that take ``seqused_k``.

    A position is packed when ``attention_mask`` or ``unused_mask`` marks it, so without
    ``unused_mask`` ``seqused == cu_seqlens.diff()``.
    """
    batch, seqlen = hidden_states.shape[:2]
    _check_mask("attention_mask", attention_mask, batch, seqlen)
    used = attention_mask.bool()
    packed = used
    if unused_mask is not None:
        _check_mask("unused_mask", unused_mask, batch, seqlen)
        packed = used | unused_mask.bool()
    seqlens = packed.sum(dim=-1, dtype=torch.int32)
    seqused = used.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(packed.flatten()).flatten()
    flat = hidden_states.reshape(batch * seqlen, *hidden_states.shape[2:])
    return (index_first_axis(flat, indices), indices, _cumulative(seqlens),
            _max_or_zero(seqlens), seqused)


def pad_input(hidden_states, indices, batch, seqlen):
    """The inverse of ``unpad_input``: packed ``(total, ...)`` rows back to
    ``(batch, seqlen, ...)``, zeros at the positions ``indices`` does not name."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.view(batch, seqlen, *hidden_states.shape[1:])


def unpad_input_for_concatenated_sequences(hidden_states, attention_mask_in_length):
    """Pack a batch whose rows each hold several sequences back to back.

    hidden_states: ``(batch, seqlen, ...)``.
    attention_mask_in_length: ``(batch, seqlen)``, int: row ``b`` lists the lengths of the
        sequences stored one after another at the start of row ``b`` of ``hidden_states``,
        followed by zeros (zeros in between are skipped). E.g. with seqlen 6,
        ``[[2, 3, 0, 0, 0, 0], [3, 2, 1, 0, 0, 0]]``: row 0 holds sequences of 2 and 3 tokens
        and one position of padding, row 1 sequences of 3, 2 and 1 tokens.

    Returns ``(hidden_states, indices, cu_seqlens, max_seqlen_in_batch)``, as ``unpad_input``
    but with one ``cu_seqlens`` segment per sequence (not per row) and no ``seqused``, as in
    flash_attn 2.x. Raises ValueError when a row's lengths are negative or add up to more than
    ``seqlen``.
    """
    batch, seqlen = hidden_states.shape[:2]
    _check_mask("attention_mask_in_length", attention_mask_in_length, batch, seqlen)
    lengths = attention_mask_in_length.flatten()
    seqlens = lengths[lengths != 0].to(torch.int32)
    used = attention_mask_in_length.sum(dim=-1)
    # One device-to-host copy for the check and max_seqlen_in_batch together.
    lo, hi, longest = (torch.stack([lengths.min(), used.max(), lengths.max()]).tolist()
                       if lengths.numel() else (0, 0, 0))
    if lo < 0 or hi > seqlen:
        raise ValueError(
            f"attention_mask_in_length: each row must hold non-negative sequence lengths that "
            f"add up to at most seqlen={seqlen}; got a smallest entry of {lo} and a largest "
            f"row sum of {hi}")
    positions = torch.arange(seqlen, device=used.device)
    packed = positions < used.unsqueeze(-1)                 # the first used[b] positions of row b
    indices = torch.nonzero(packed.flatten()).flatten()
    flat = hidden_states.reshape(batch * seqlen, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, _cumulative(seqlens), int(longest)


def _check_mask(name, mask, batch, seqlen):
    if tuple(mask.shape) != (batch, seqlen):
        raise ValueError(f"{name} must have shape (batch, seqlen) = {(batch, seqlen)} like "
                         f"hidden_states' first two dims, got {tuple(mask.shape)}")


def _cumulative(seqlens):
    return F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))


def _max_or_zero(seqlens):
    return int(seqlens.max()) if seqlens.numel() else 0
