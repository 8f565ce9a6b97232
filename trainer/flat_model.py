"""A worker's trainable parameters laid out as one flat vector (`trainer.algorithm.Layout`):
the gradient buffer every parameter's `.grad` is a view of, and the parameters' values copied
out of and into that layout. The codec, the server's replies and local SGD's pseudo-gradient
all speak in this layout, so one object owns the mapping."""

from __future__ import annotations

import torch
from torch import nn

from trainer.algorithm import Layout


class FlatModel:
    """The model's trainable parameters in layout order, and their flat gradient."""

    def __init__(self, model: nn.Module, layout: Layout, device: torch.device) -> None:
        self.layout = layout
        self.params = dict((n, p) for n, p in model.named_parameters() if p.requires_grad)
        # The tensors that go through the codec: the layout is the run's, so the set is too.
        self.compressed = frozenset(self.params[n] for n, off in zip(layout.names, layout.offsets)
                                    if off >= layout.dense_numel)
        self.grad = torch.zeros(layout.numel, device=device)
        self.bind()

    def _spans(self):
        return zip(self.layout.names, self.layout.offsets, self.layout.numels)

    def bind(self) -> None:
        """Every parameter's `.grad` a view of the flat buffer again."""
        for name, off, n in self._spans():
            p = self.params[name]
            p.grad = self.grad[off : off + n].view_as(p)

    def zero(self) -> None:
        """Zero the flat gradient, keeping the views."""
        self.grad.zero_()
        self.bind()

    def collect(self) -> None:
        """Autograd accumulates into the bound views; copy back any `.grad` user code replaced."""
        base = self.grad.data_ptr()
        end = base + self.grad.numel() * self.grad.element_size()
        if all(p.grad is not None and base <= p.grad.data_ptr() < end for p in self.params.values()):
            return
        for name, off, n in self._spans():
            g = self.params[name].grad
            self.grad[off : off + n].copy_(g.reshape(-1) if g is not None else 0)
        self.bind()

    def values(self) -> torch.Tensor:
        """A flat fp32 copy of the parameters."""
        return torch.cat([self.params[n].detach().reshape(-1).float() for n in self.layout.names])

    def load(self, flat: torch.Tensor) -> None:
        """Every parameter from `flat` (layout order)."""
        with torch.no_grad():
            for name, off, n in self._spans():
                p = self.params[name]
                p.copy_(flat[off : off + n].view_as(p))

    def _pieces(self, start: int, stop: int):
        """(parameter, its first and end element, the same in [start, stop)) for each parameter
        overlapping the range."""
        for name, off, n in self._spans():
            a, b = max(start, off), min(stop, off + n)
            if a < b:
                yield self.params[name], a - off, b - off, a - start, b - start

    def span_values(self, start: int, stop: int) -> torch.Tensor:
        """A flat fp32 copy of elements [start, stop) of the layout (a streaming fragment)."""
        return torch.cat([p.detach().reshape(-1)[a:b].float() for p, a, b, _, _ in self._pieces(start, stop)])

    def load_span(self, values: torch.Tensor, start: int, stop: int) -> None:
        """Elements [start, stop) of the layout from `values`, the others left as they are."""
        with torch.no_grad():
            for p, a, b, s, e in self._pieces(start, stop):
                if p.is_contiguous():
                    p.view(-1)[a:b].copy_(values[s:e])
                else:  # no flat view to write through: the whole tensor, its other elements as they are
                    whole = p.reshape(-1).clone()
                    whole[a:b] = values[s:e]
                    p.copy_(whole.view_as(p))
