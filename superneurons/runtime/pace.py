"""Pacing the host to the compute stream in forward (executor Rule 10, which says why)."""

import collections

import torch


# Rule 10: forward layers the host may have queued ahead of the compute stream when it waits
# (0: all queued before). Two, waiting before every layer, kept the device fed while the host
# prepared the next layer and held ResNet-101's budget at batch 896, where a lead of many short
# layers did not (pace_ab_*.json, claims_pace_lead_1ms.json)
PACE_LEAD = 2
# Rule 10: a forward whose last one still had data to move after waiting, after more than this
# share of its layers, waits before every layer. Waiting only where the pool might move data,
# ResNet-101 at batch 896 waited at 84% of its forward layers and passed its budget; waiting
# before every layer, it held it. The rows of ratio_*_pace_at_*.json waited at about 5% of theirs
# at most (28 of DenseNet-121's 552): they peaked the same either way, and ran up to 0.15 of
# plain's speed faster waiting only there. A quarter lies between.
PACE_EVERY_LAYER_SHARE = 0.25


class Pace:
    """Rule 10: the host marks the compute stream before each forward layer, and waits until the
    stream has run all it queued before the layer PACE_LEAD positions back: where the pool may
    move data after a layer (it holds more than its room, or copies must start early), and
    before every layer in a forward that follows one where the pool did so after many of its
    layers, or none that ended (the first paced forward; one after a forward that raised). The
    pool's copies on their own streams run on; elsewhere the host runs ahead as PyTorch lets
    it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.marks: collections.deque = collections.deque()    # (position, event)
        self.everywhere = True
        self.moves: set = set()      # positions of this forward where the pool moves data
        self.ended = None            # the moves of the last forward that ended
        self.waits = 0               # this forward's settles that waited

    def begin_forward(self, num_layers: int) -> None:
        """Marks are positions of one forward: a forward that raised leaves its own behind."""
        self.everywhere = self.ended is None or \
            len(self.ended) > PACE_EVERY_LAYER_SHARE * num_layers
        self.ended = None
        self.marks.clear()
        self.moves, self.waits = set(), 0

    def end_forward(self) -> None:
        self.ended = self.moves

    def before_layer(self, position: int) -> None:
        self.marks.append((position, torch.cuda.current_stream(self.device).record_event()))
        if self.everywhere:
            self.settle(position)

    def moving(self, position: int) -> None:
        """After the layer at ``position``, settled, the pool still has data to move: counted
        on the device as it is, whether this forward waited before every layer or not."""
        self.moves.add(position)

    def settle(self, position: int) -> None:
        last = None
        while self.marks and position - self.marks[0][0] >= PACE_LEAD:
            last = self.marks.popleft()[1]
        if last is not None:         # the stream ran the earlier marks before it
            last.synchronize()
            self.waits += 1
