"""Autograd's gradient buffers through backward: when each is made and how long it lives.

Autograd keeps one input buffer per value whose gradient is still to be consumed (its slot
here), from the first gradient that reaches the value until the backward of the layer that
produced it. A slot refers to one gradient buffer; several slots may refer to the same one.

Rule 1: a layer's backward makes a fresh buffer for each input it sends a gradient to, of the
        input's size, except where it hands on the buffer holding its output's gradient:
        - an add (JOIN) hands the same tensor to each input of the output's shape and dtype
          (one it broadcast, cast or scaled by alpha gets a fresh one);
        - a concatenation (CONCAT) hands a slice of it to each input;
        - a view whose backward is a view (VIEWS) hands it on reshaped. Other views allocate:
          a slice's or a select's backward makes a zero buffer of its input's size, a split's
          concatenates its pieces into one;
        - a cast to the dtype its input has already (HF's logits.float() in fp32) hands it on:
          the cast's backward casts the gradient to that dtype, which returns it unchanged.
Rule 2: a second gradient reaching a slot is added in place where the slot holds a whole buffer
        no other slot refers to and the incoming one is another; otherwise the sum is a fresh
        buffer and the slot lets go of the old (the same tensor twice, as in h + h, is summed
        out of place). An incoming fresh buffer lives only through that step.
Rule 3: a buffer lives until no slot refers to it; a model input's slot, its .grad, to the end.
Rule 4: a layer that computes in a narrower dtype than an input (autocast's bfloat16 linear
        of a float32 activation) makes that input's gradient in its own dtype first, then the
        cast: both live through its step. (Its parameters' gradients take the same detour;
        they are not counted here, as parameter gradients are resident: scratch.py Rule 3.)
Rule 5: backward starts from the model's outputs, each with a gradient from outside, except an
        output that a loss function's inputs are computed from, where that loss flows into a
        loss among the outputs (a language model's logits beside its loss, given labels): the
        caller's backward is taken to start from the loss alone, and that output's gradient
        to come from the loss inside. Counting both held a second
        logits-sized buffer that plain PyTorch never makes (GPT-2 small's floor read 3.07 GiB
        high). Where a gradient does reach such an output from outside (a distillation loss on
        the logits beside the model's), the executor sees it and the wrapper plans again with
        it (LayerGraph.outside_gradients; runtime/outside.py). Of an output and the output it
        was cast from (capture's trace.py Rule 7: the model returns one of them), only the
        larger gets a gradient from outside.
"""

from ..capture import Kind, LayerGraph

# views whose backward is a view of the gradient (ATen overload packets, tensor methods,
# functions and modules by lowercase name): nothing is allocated for their input
VIEWS = frozenset({"view", "_unsafe_view", "reshape", "permute", "transpose", "t", "squeeze",
                   "unsqueeze", "flatten", "unflatten", "alias", "view_as", "reshape_as",
                   "contiguous"})
# casts: their backward is the one cast back (Rule 4 is about layers that compute)
CASTS = frozenset({"to", "_to_copy", "type", "type_as", "float", "half", "bfloat16", "double"})


def gradient_buffers(graph: LayerGraph, timeline) -> list:
    """(value, first step, last step, bytes or None for the value's own) of every gradient
    buffer the step's backward makes."""
    return _GradientFlow(graph, timeline).run()


def outputs_behind_a_loss(graph: LayerGraph) -> frozenset:
    """The outputs a loss function's inputs are computed from, where that loss flows into a
    loss among the outputs (a floating scalar needing a gradient): their gradient is taken to
    come from inside (Rule 5). A scalar made without a loss function (a z-loss of the logits,
    which a caller adds to a cross-entropy of its own) marks nothing. Only outputs the executor
    can watch (watched_layer)."""
    values, layers = graph.values, graph.layers
    losses = [v for v in graph.output_values if values[v].requires_grad and
              values[v].shape == () and values[v].dtype.is_floating_point]
    loss_layers = [layers[i] for i in _producers_behind(graph, losses)
                   if _is_loss_function(layers[i])]
    behind = _producers_behind(graph, [v for layer in loss_layers for v in layer.inputs])
    return frozenset(v for v in graph.output_values
                     if values[v].producer in behind and v not in losses
                     and watched_layer(graph, v) is not None)


def watched_layer(graph: LayerGraph, value: int) -> int | None:
    """The layer whose output runtime/outside.py watches for the output ``value``: its
    producer, or, where that is a cast to the dtype its input has (which returns its input,
    as HF's logits.float() in fp32), the input's producer, so that every layer of the model
    reading that tensor reads the watched view; None where that layer makes more than one
    output."""
    values, layers = graph.values, graph.layers
    index = values[value].producer
    layer = layers[index]
    if _op_name(layer) in CASTS and layer.inputs and \
            values[layer.inputs[0]].dtype == values[value].dtype and \
            values[layer.inputs[0]].producer is not None:
        index = values[layer.inputs[0]].producer
    return index if len(layers[index].outputs) == 1 else None


def _producers_behind(graph: LayerGraph, values: list) -> set:
    """The layers that ``values`` are computed from, their producers included."""
    reached, frontier = set(), [graph.values[v].producer for v in values]
    while frontier:
        index = frontier.pop()
        if index is None or index in reached:
            continue
        reached.add(index)
        frontier.extend(graph.values[v].producer for v in graph.layers[index].inputs)
    return reached


def _is_loss_function(layer) -> bool:
    """ATen's and torch.nn.functional's losses by name (cross_entropy_loss, nll_loss_forward,
    mse_loss, capture's sliced cross-entropy, ...), and the three without "loss" in it."""
    name = _op_name(layer)
    return "loss" in name or name in ("kl_div", "binary_cross_entropy",
                                      "binary_cross_entropy_with_logits")


def _op_name(layer) -> str:
    node = layer.node
    if node.op == "call_function":
        packet = getattr(node.target, "overloadpacket", None)
        return (packet.__name__ if packet is not None else getattr(node.target, "__name__", ""))
    if node.op == "call_method":
        return node.target
    return type(layer.module).__name__.lower() if layer.module is not None else ""


def _smaller_of_cast_pairs(graph: LayerGraph) -> frozenset:
    """Of an output and the output it was cast from (capture's trace.py Rule 7: the model
    returns one of the two), the one whose gradient from outside would be the smaller: one
    gradient is counted, as large as either's."""
    values = graph.values
    return frozenset(min((cast, source), key=lambda v: (values[v].nbytes, v == source))
                     for cast, source in graph.cast_from.items()
                     if cast is not None and source is not None)


class _GradientFlow:
    def __init__(self, graph: LayerGraph, timeline):
        self.graph, self.timeline = graph, timeline
        self.made: list = []          # [value, first, last, bytes or None: the value's]
        self.refs: list = []          # buffer -> values whose slots refer to it
        self.slot: dict = {}          # value -> (buffer, whether it holds a slice of it)

    def run(self) -> list:
        graph, n = self.graph, self.timeline.num_layers
        inside = frozenset() if graph.outside_gradients else outputs_behind_a_loss(graph)
        inside |= _smaller_of_cast_pairs(graph)
        for value in dict.fromkeys(graph.output_values):                        # Rule 5
            if graph.values[value].requires_grad and graph.values[value].producer is not None \
                    and value not in inside:
                self._receive(value, self._new(value, n), False, n)
        by_position = sorted(self.timeline.position, key=self.timeline.position.get)
        for layer_index in reversed(by_position):
            self._backward(graph.layers[layer_index], self.timeline.bwd(layer_index))
        last_step = self.timeline.num_steps - 1
        return [(value, first, last_step if self.refs[b] else last, nbytes)
                for b, (value, first, last, nbytes) in enumerate(self.made)]

    def _backward(self, layer, step: int) -> None:
        values = self.graph.values
        held = [self.slot[v] for v in layer.outputs if v in self.slot]
        if held:                      # Rule 1; a layer no gradient reached does not run
            for value in layer.inputs:        # a model input's lives on as its .grad
                if not values[value].requires_grad or \
                        (_op_name(layer) in CASTS and value != layer.inputs[0]):
                    continue                  # type_as(other), to(other): other gets none
                if self._handed_on(layer, value):
                    buffer, sliced = held[0]
                    self._receive(value, buffer, sliced or layer.kind is Kind.CONCAT, step)
                    continue
                narrower = self._narrower_bytes(layer, value)
                if narrower:                              # Rule 4: before the cast
                    self._new(value, step, narrower)
                self._receive(value, self._new(value, step), False, step)
        for value in layer.outputs:   # its producer's backward consumed the gradient
            self._let_go(value, step)

    def _handed_on(self, layer, value: int) -> bool:
        """Whether ``value`` gets the buffer of the layer's output gradient itself (Rule 1)."""
        if len(layer.outputs) != 1:
            return False
        if layer.kind is Kind.CONCAT or _op_name(layer) in VIEWS:
            return True
        out, given = self.graph.values[layer.outputs[0]], self.graph.values[value]
        if _op_name(layer) in CASTS:         # a cast to its input's own dtype hands it back
            return given.dtype == out.dtype and given.shape == out.shape
        return layer.kind is Kind.JOIN and layer.node.kwargs.get("alpha", 1) == 1 and \
            given.shape == out.shape and given.dtype == out.dtype

    def _narrower_bytes(self, layer, value: int) -> int:
        """The bytes of ``value``'s gradient in the layer's own narrower dtype (Rule 4), or 0."""
        if len(layer.outputs) != 1 or _op_name(layer) in CASTS:
            return 0
        out, given = self.graph.values[layer.outputs[0]], self.graph.values[value]
        if not out.dtype.is_floating_point or given.dtype.itemsize <= out.dtype.itemsize:
            return 0
        return given.nbytes // given.dtype.itemsize * out.dtype.itemsize

    def _new(self, value: int, step: int, nbytes: int | None = None) -> int:
        """A fresh buffer for ``value``'s gradient (``nbytes``: other than the value's own)."""
        self.made.append([value, step, step, nbytes])
        self.refs.append(set())
        return len(self.made) - 1

    def _receive(self, value: int, buffer: int, sliced: bool, step: int) -> None:
        if value not in self.slot:
            self.slot[value] = (buffer, sliced)
            self.refs[buffer].add(value)
            return
        old, old_sliced = self.slot[value]
        if old_sliced or old == buffer or self.refs[old] != {value}:     # Rule 2: out of place
            self._let_go(value, step)
            self._receive(value, self._new(value, step), False, step)
        # the incoming buffer, where fresh, is referred to by no slot: it ends at this step

    def _let_go(self, value: int, step: int) -> None:
        held = self.slot.pop(value, None)
        if held is None:
            return
        self.refs[held[0]].discard(value)
        if not self.refs[held[0]]:
            self.made[held[0]][2] = step
