"""The state tier of the Unified Tensor Pool: model state in host memory, computed on the device.

Rule 1: parameters and buffers stay the model's own tensors, in host memory (pinned in place on
        CUDA, `tensor.data`), so the user's optimizer steps them there, state_dict returns them
        and load_state_dict reaches the next step. A layer reads device copies, fetched one
        layer ahead on the copy stream and dropped after the layer (but resident ones, Rule 7).
Rule 2: what autograd saves of a copy (a convolution's weight) becomes a StateRef: the host
        tensor, fetched again for the backward that reads it (a resident one's kept copy is
        read, Rule 7). Its version is checked there: a parameter changed between forward and
        backward fails as plain PyTorch's backward does.
Rule 3: a copy's gradient is summed on the device over the uses of its parameter that the
        backward running reaches (autograd's graph task: every forward whose graph it runs,
        two forwards summed into one loss among them), in the order autograd delivers them
        (its own input buffer sums so), then copied to host memory on the copy stream as soon
        as the last of those uses has delivered. When backward ends, the
        host waits for the copies and sets .grad, or adds to it where a gradient is already
        there (accumulation over micro-batches: AccumulateGrad adds in place). The gradient
        never waits on the device for the rest of backward. A backward that raises sets no
        .grad (autograd runs no callback after an error); the next step drops what it sent.
        Uses that delivered no gradient (a custom Function's backward returned None for the
        parameter) leave .grad as plain PyTorch leaves it.
Rule 4: a buffer a layer writes in place (running statistics) is copied back to the host after
        the layer, in stream order; host reads are safe once backward has ended (Rule 3 waits).
        A replay writes only its own copies.
Rule 5: what the tier cannot make exact is refused before the first step: hooks on parameters
        (autograd would call them on the copies' gradients, not the parameter's), sparse
        gradients, create_graph (double backward through the copies).
Rule 6: with a process group (data_parallel.py), a gradient complete on the device is averaged
        over the group before it is sent (Rule 3), as DistributedDataParallel would average it.
Rule 7: state the plan keeps resident (planner/state.py) is fetched once a step and its copy
        kept for the step: its later readers, replays and backward (StateRefs) read it. A copy
        serves only the host tensor it was made from, unchanged: the same object at the same
        address and version, else it is fetched again. No copy outlives its step, frozen
        state's neither: copies go when backward ends, as a forward without grad ends, or at
        the next step. Between steps an optimizer writes parameters without counting a version
        (AdamW(..., fused=True) on the CPU), and so does any write through .data (an EMA
        teacher's p.data.mul_(...)); a copy kept across steps would miss them. A write through
        .data between a step's forward and its backward is missed too: plain PyTorch's
        backward would read the new values, this one the copy. State a
        layer writes is never resident (Rule 4). The copies also go when the executor is
        released or closed and when another plan of the wrapper runs (module Rule 6); the
        master stays on the host (Rule 1).
"""

import bisect
import collections
import contextlib
import weakref

import torch
from torch import nn

from .handles import rebuild, storage_bytes, view_of


class _Fetch(torch.autograd.Function):
    """A parameter's device copy in autograd: its gradient goes to the tier (Rule 3). The copy is
    passed in a box, so autograd takes it for this function's own output."""

    @staticmethod
    def forward(ctx, host, tier, box):
        ctx.tier, ctx.host = tier, host
        tier.fetches.add(ctx)           # Rule 3: a use of ``host`` a backward may reach
        ctx.set_materialize_grads(False)    # a use that gave no gradient: None, not zeros
        return box[0]

    @staticmethod
    def backward(ctx, grad):
        ctx.tier.gradient(ctx.host, grad)
        return None, None, None


class StateRef:
    """A saved copy of model state: fetched again in backward (Rule 2)."""

    __slots__ = ("tier", "host", "view", "version", "step")

    def __init__(self, tier, host: torch.Tensor, view, step: int):
        self.tier, self.host, self.view, self.version = tier, host, view, host._version
        self.step = step          # the backward step that reads it

    def get(self) -> torch.Tensor:
        self.tier.enter_backward_step(self.step)
        # a parameter only: buffers are written by the forward itself after a layer saved
        # them (state Rule 4), as plain PyTorch's kernels write them in place
        if self.host.requires_grad and self.host._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: a model parameter of shape {tuple(self.host.shape)} changed "
                "between forward and backward (an optimizer step before backward?)")
        copy = rebuild(self.tier.fetch_saved(self.host), self.view)
        copy.superneurons_copy_of = self.host
        return copy


def check_state_tier(model: nn.Module) -> None:
    """Rule 5, before anything is moved."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError(
            "DistributedDataParallel inside sn.wrap(..., state='host') would average nothing: "
            "its hooks wait for AccumulateGrad, which the tier does not run. Wrap the model "
            "itself and pass the group: sn.wrap(model, ..., state='host', process_group=group)")
    for name, parameter in model.named_parameters():
        if parameter._backward_hooks or getattr(parameter, "_post_accumulate_grad_hooks", None):
            raise ValueError(
                f"parameter {name!r} has a hook: with state='host' its gradient is made on the "
                "device copies and sent to the host by superneurons, so the hook would not see "
                "it. Remove the hook, or keep the state on the device (state='device')")
    for name, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
            raise ValueError(
                f"{name or type(module).__name__} makes sparse gradients, which state='host' "
                "does not stream: build it with sparse=False, or keep the state on the device")


class StateTier:
    def __init__(self, model: nn.Module, device: torch.device, mover):
        self.model, self.device, self.mover = model, device, mover
        self.cuda = device.type == "cuda"
        self.ahead: dict = {}       # id(host tensor) -> (device bytes, event): fetched ahead
        # Rule 7: the plan's resident state this step, and the copies kept of it
        self.resident: dict = {}    # id(host tensor) -> host tensor
        self.kept: dict = {}        # id(host tensor) -> (host, version, address, device bytes)
        # forward: what the layer running reads and writes, and values that view state
        self.layer_reads: dict = {}  # storage of a copy it reads -> host tensor
        self.written: list = []      # (host, copy) of state it writes in place
        self.views: dict = {}        # fx node whose value views a copy -> host tensor
        # backward
        self.saved_at: dict = {}    # backward step -> {id(host): host} its StateRefs read
        self.saved_steps = None     # those steps in order, once backward begins
        self.reading: dict = {}     # id(host tensor) -> device bytes of the backward step now
        self.reading_step = None
        # Rule 3: the _Fetch nodes of every graph still alive, and how many of them the
        # backward running (autograd's graph task) reaches, per parameter
        self.fetches = weakref.WeakSet()
        self.task, self.reaching = None, {}
        self.arrived: dict = {}     # id(parameter) -> [gradients delivered, device sum]
        self.copies: list = []      # (parameter, host gradient bytes, event, device gradient)
        self.sent = 0               # copies before this one have freed their device gradient
        self.finishing = False
        self.moved_bytes = 0
        # Rule 6: the wrapper's DataParallel where this forward's backward syncs, else None
        self.data_parallel = None
        self.syncing = None          # data_parallel at this step's forward
        self.round = None            # its collectives in the backward running

    # -- forward ---------------------------------------------------------------------------------
    def begin_step(self, resident=()) -> None:
        """A new step: the model's tensors are read again (a user may have replaced one, as
        load_state_dict(assign=True) does) and brought to host memory where they are not;
        ``resident``: the host tensors the plan keeps on the device now (Rule 7)."""
        to_host_memory(self.model, self.device)
        if self.finishing:
            self._forget_backward()
        self.resident = {id(host): host for host in resident}
        self.kept = {}                  # Rule 7: a partial backward may have left some
        self._drop_ahead()
        self.views, self.saved_at, self.saved_steps = {}, {}, None
        self.reading, self.reading_step = {}, None
        self.moved_bytes = 0
        self.syncing = self.data_parallel                                     # Rule 6

    def _forget_backward(self) -> None:
        """A backward that raised never ran _finish (autograd runs no callback after an
        error): its gradients were not set, as plain PyTorch's from a failed backward may
        not all be; none of them may reach a later step's."""
        if self.cuda:
            self.mover.d2h.synchronize()        # its copies write into host memory dropped now
        self._backward_over()

    def _backward_over(self) -> None:
        """Rule 3's bookkeeping of one backward, gone: the next starts afresh."""
        self.arrived.clear()
        self.task, self.reaching = None, {}
        self.copies, self.sent = [], 0
        self.round = None
        self.finishing = False

    def end_forward(self) -> None:
        """Views noted in forward are not read again (replays note their own); a forward that
        no backward follows (no grad) waits here for its written-back buffers."""
        self.layer_reads, self.views = {}, {}
        if not torch.is_grad_enabled():
            self.kept = {}              # Rule 7: no backward will read them
            if self.cuda:
                torch.cuda.current_stream(self.device).synchronize()

    def begin_layer(self) -> None:
        self.layer_reads, self.written = {}, []

    def read_input(self, node, tensor: torch.Tensor) -> None:
        """An input that views a state copy (a transposed weight, made by the layer before) is
        state for this layer: what autograd saves of it is fetched again (Rule 2)."""
        host = self.views.get(node)
        if host is not None:
            self.layer_reads[tensor.untyped_storage().data_ptr()] = host

    def fetch_for_layer(self, host: torch.Tensor, trains: bool, writes: bool) -> torch.Tensor:
        """``host``'s copy for the layer running; ``writes``: it writes the copy in place, which
        goes back to the host after it (Rule 4)."""
        copy = self.fetch(host, trains)
        self.layer_reads[copy.untyped_storage().data_ptr()] = host
        if writes:
            self.written.append((host, copy))
        return copy

    def end_layer(self, node, out) -> None:
        for host, copy in self.written:                               # Rule 4
            self.write_back(host, copy)
        if isinstance(out, torch.Tensor) and self.layer_reads:
            host = self.layer_reads.get(out.untyped_storage().data_ptr())
            if host is not None:
                self.views[node] = host

    @contextlib.contextmanager
    def module_on_device(self, module: nn.Module, trains: bool):
        """A leaf module (fx) runs on copies of its parameters and buffers; in a forward
        (``trains``) every buffer goes back to the host after it: a kernel may write one without
        counting a version (native_batch_norm's running statistics)."""
        swapped = []
        try:
            for owner in module.modules():
                for kind in ("_parameters", "_buffers"):
                    slots = getattr(owner, kind)
                    for name, host in slots.items():
                        if host is not None:
                            buffer = kind == "_buffers"
                            slots[name] = self.fetch_for_layer(host, trains and not buffer,
                                                               trains and buffer)
                            swapped.append((slots, name, host))
            yield
        finally:
            for slots, name, host in swapped:
                slots[name] = host
            for host, copy in self.written:
                self.write_back(host, copy)
            self.written = []

    def prefetch_layer(self, layer, env: dict, written_state: set) -> None:
        """Start copying what ``layer`` reads, but state some layer writes (running statistics
        are fetched when read, after the write before them)."""
        hosts = [env[node] for node in layer.state_reads
                 if node in env and node not in written_state]
        if layer.module is not None:
            hosts += list(layer.module.parameters())
        self.prefetch(t for t in hosts if isinstance(t, torch.Tensor))

    def prefetch(self, hosts) -> None:
        """Start copying the next layer's state (Rule 1), but what is kept (Rule 7)."""
        for host in hosts:
            if id(host) not in self.ahead and self._kept_copy(host) is None:
                self.ahead[id(host)] = self._start(host)

    def _start(self, host: torch.Tensor):
        source = storage_bytes(host)
        self.moved_bytes += source.numel()
        return self.mover.to_device(source)

    def fetch_bytes(self, host: torch.Tensor) -> torch.Tensor:
        """A device copy of the storage behind ``host``: fetched ahead, or now."""
        device_bytes = self.reading.get(id(host))
        if device_bytes is None:
            device_bytes = self._kept_copy(host)
        if device_bytes is not None:
            return device_bytes
        device_bytes, event = self.ahead.pop(id(host), None) or self._start(host)
        self.mover.ready(device_bytes, event)
        if self.resident.get(id(host)) is host:                                   # Rule 7
            # resident state is not written during a step (never a layer's, Rule 4), so the
            # version now is the one the copy was started from
            self.kept[id(host)] = (host, host._version, _address(host), device_bytes)
        return device_bytes

    def _drop_ahead(self) -> None:
        """Free the copies fetched ahead and not read (mover Rule 2)."""
        for _, event in self.ahead.values():
            self.mover.abandon(event)
        self.ahead.clear()

    def __del__(self):
        # a backward that raised after fetching ahead, and no step after it, leaves copies
        # unread that may still be running when the tier goes
        if self.ahead:
            self._drop_ahead()

    def _kept_copy(self, host: torch.Tensor):
        """Rule 7: the kept device bytes of ``host``, if made from it as it is now."""
        kept = self.kept.get(id(host))
        if kept is None or kept[0] is not host or kept[1] != host._version or \
                kept[2] != _address(host):
            return None
        return kept[3]

    def release(self) -> None:
        """Drop every copy this tier holds on the device between layers or steps; a StateRef
        still to be read fetches its state again, and keeps no copy (Rule 7)."""
        self._drop_ahead()
        self.kept.clear()
        self.resident = {}

    def fetch_saved(self, host: torch.Tensor) -> torch.Tensor:
        """Rule 2: saved state for the backward step now; its readers in that step share it."""
        device_bytes = self.reading[id(host)] = self.fetch_bytes(host)
        return device_bytes

    def fetch(self, host: torch.Tensor, trains: bool) -> torch.Tensor:
        """``host``'s device copy for a layer; ``trains``: autograd takes the copy's gradient
        to the parameter (a forward, not a replay)."""
        copy = rebuild(self.fetch_bytes(host), view_of(host))
        copy.superneurons_copy_of = host        # what a custom Function asks of it (functions.py)
        if trains and host.requires_grad and torch.is_grad_enabled():
            return _Fetch.apply(host, self, (copy,))
        return copy.requires_grad_(host.requires_grad and torch.is_grad_enabled())

    def write_back(self, host: torch.Tensor, copy: torch.Tensor) -> None:
        """Rule 4: in stream order, after the layer that wrote ``copy``."""
        with torch.no_grad():
            host.copy_(copy, non_blocking=self.cuda)

    # -- backward --------------------------------------------------------------------------------
    def reads(self, pointer: int) -> bool:
        """Whether a storage autograd saves is a copy the layer running reads."""
        return pointer in self.layer_reads

    def saved(self, pointer: int, view, step: int) -> StateRef:
        """Rule 2: what autograd keeps of a saved copy, read at backward ``step``."""
        host = self.layer_reads[pointer]
        self.saved_at.setdefault(step, {})[id(host)] = host
        return StateRef(self, host, view, step)

    def enter_backward_step(self, step: int) -> None:
        """Backward reads saved state at ``step``: the copies of the step before go, and the
        state of the next step with saved state is fetched ahead."""
        if self.reading_step == step:
            return
        if self.saved_steps is None:
            self.saved_steps = sorted(self.saved_at)
        self.reading, self.reading_step = {}, step
        at = bisect.bisect_right(self.saved_steps, step)
        if at < len(self.saved_steps):
            self.prefetch(self.saved_at[self.saved_steps[at]].values())

    def gradient(self, host: torch.Tensor, grad: torch.Tensor) -> None:
        """Rule 3: one use's gradient."""
        if torch.is_grad_enabled():
            raise RuntimeError("backward(create_graph=True) is not supported with state='host' "
                               "(the copies' gradients are sent to host memory): keep the state "
                               "on the device for second-order gradients")
        if grad is not None and grad.is_sparse:
            raise RuntimeError("a sparse gradient reached a parameter kept on the host")
        if not self.finishing:
            self.finishing = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self.round = self.syncing.begin_backward() if self.syncing is not None else None
        task = torch._C._current_graph_task_id()
        if task != self.task:
            self.task, self.reaching = task, collections.Counter(
                id(use.host) for use in list(self.fetches)
                if torch._C._will_engine_execute_node(use))
        key = id(host)
        arrived = self.arrived.get(key)
        if arrived is None:
            arrived = self.arrived[key] = [0, None, host]
        arrived[0] += 1
        if grad is not None:
            arrived[1] = grad if arrived[1] is None else arrived[1] + grad
        if arrived[0] >= self.reaching.get(key, 1):
            self._complete(self.arrived.pop(key))
        self._drop_sent()

    def _complete(self, arrived) -> None:
        """A parameter's gradient is complete here: sent, or first averaged over the process
        group (Rule 6), whose fixed order may hand on several at once. Where no use gave one
        (a custom Function's backward returned None for it), .grad stays as plain PyTorch
        leaves it; the group averages zeros, as every rank averages every parameter."""
        if self.round is None:
            if arrived[1] is not None:
                self._send(arrived)
            return
        if arrived[1] is None:
            arrived[1] = torch.zeros(arrived[2].shape, dtype=arrived[2].dtype, device=self.device)
        for host, grad, replaces in self.round.ready(arrived[2], arrived[1]):
            self._send((None, grad, host), replaces)

    def _send(self, arrived, replaces: bool = False) -> None:
        """``replaces``: the gradient sent already holds .grad (an average of it, Rule 6)."""
        _, grad, host = arrived
        if host.grad is None:
            target = torch.empty_like(host, pin_memory=self.cuda)
        else:
            target = torch.empty_like(host.grad, pin_memory=self.cuda)
        event = self.mover.to_host(grad, target)
        self.moved_bytes += grad.numel() * grad.element_size()
        self.copies.append((host, target, event, grad, replaces))

    def _drop_sent(self) -> None:
        """Free the device gradients whose copies are done (mover Rule 1), in the order they
        were sent (one stream): each copy is asked once it is the oldest still waiting."""
        copies = self.copies
        while self.sent < len(copies):
            host, target, event, _, replaces = copies[self.sent]
            if event is not None and not event.query():
                break
            copies[self.sent] = (host, target, event, None, replaces)
            self.sent += 1

    def _finish(self) -> None:
        """Rule 3, as backward ends: gradients every use did not deliver (a partial backward)
        are sent too; then the host waits and sets or accumulates .grad."""
        for arrived in list(self.arrived.values()):
            self._complete(arrived)
        if self.round is not None:                                            # Rule 6
            for host, grad, replaces in self.round.finish():
                self._send((None, grad, host), replaces)
        if self.cuda:
            self.mover.d2h.synchronize()
            torch.cuda.current_stream(self.device).synchronize()    # buffers written back
        with torch.no_grad():
            for host, target, _, _, replaces in self.copies:
                if host.grad is None:
                    host.grad = target
                elif replaces:
                    host.grad.copy_(target)
                else:
                    host.grad += target
        self._backward_over()
        # what a partial backward fetched ahead for a step it did not reach: not kept past it
        self._drop_ahead()
        # resident copies are for this step alone (Rule 7): free before the optimizer steps
        self.kept = {}
        self.reading, self.reading_step = {}, None


def _address(host: torch.Tensor) -> int:
    return host.untyped_storage().data_ptr()


def to_host_memory(model: nn.Module, device: torch.device) -> None:
    """Rule 1: the model's tensors in host memory, in place, pinned where copies to ``device``
    run asynchronously (CUDA)."""
    cuda = device.type == "cuda"
    if cuda:
        from .host import _pin_with_threads
        _pin_with_threads()              # host Rule 6: pinning at the link's pace
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            data = tensor.data
            if data.device.type != "cpu":
                data = data.cpu()
            if cuda and not data.is_pinned():
                data = data.pin_memory()
            if data is not tensor.data:
                tensor.data = data
