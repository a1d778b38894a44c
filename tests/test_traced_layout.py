"""capture/aten.py, with_traced_layout: an exported operation's meta outputs take the layout
export traced on the device, only where that is a view of the same bytes."""

import types

import torch

from superneurons.capture.aten import with_traced_layout


def _node(val):
    return types.SimpleNamespace(meta={"val": val})


def _fused_attention_layout():
    """(batch, heads, tokens, dim) laid out as (batch, tokens, heads, dim) in memory."""
    return torch.empty(2, 5, 3, 4, device="meta").transpose(1, 2)


def test_a_contiguous_meta_output_takes_the_traced_layout_over_its_own_bytes():
    out = torch.empty(2, 3, 5, 4, device="meta", requires_grad=True) * 1
    (relaid, aux) = with_traced_layout(_node((_fused_attention_layout(), None)), (out, None))
    assert relaid.stride() == _fused_attention_layout().stride() and aux is None
    assert relaid.untyped_storage().nbytes() == out.untyped_storage().nbytes()
    assert relaid.requires_grad and relaid.grad_fn is not None
    assert relaid.transpose(1, 2).view(2, 5, 12).shape == (2, 5, 12)    # nanoGPT's view works


def test_other_layouts_and_shapes_are_left_as_they_are():
    out = torch.empty(2, 3, 5, 4, device="meta")
    overlapping = torch.empty(2, 3, 5, 1, device="meta").expand(2, 3, 5, 4)
    for val in (overlapping, torch.empty(2, 3, 5, 5, device="meta"), None,
                (_fused_attention_layout(), _fused_attention_layout())):
        result = with_traced_layout(_node(val), out)
        assert result is out
    assert with_traced_layout(_node(out), out) is out
