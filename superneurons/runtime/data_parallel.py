"""Data parallelism with the model's state in host memory: DistributedDataParallel's semantics,
kept by the state tier itself (``sn.wrap(model, state="host", process_group=group)``).

DDP cannot wrap such a model: its reducer hooks the parameters' AccumulateGrad nodes, which the
tier never runs (state.py Rule 3); it averaged the wrong gradients, silently (the wrapper now
refuses it, module.py Rule 7). The tier does what DDP's defaults do instead:

Rule 1: at wrap, the ranks check that they hold the same parameter shapes, and every parameter
        and buffer is broadcast from the group's rank 0 (DDP's init_sync).
Rule 2: before a forward, buffers are broadcast from rank 0 where DDP's default
        (forward_sync_buffers) would: when the forward before it ran with grad and synced.
Rule 3: in a synced backward, each parameter's gradient, once final on the device, joins a
        bucket (one dtype, about REDUCE_BUCKET_BYTES); a full bucket is multiplied by 1/world
        size and summed over the group (one all-reduce) before its gradients go to host
        memory: DDP's reducer does the same (at::mul_out by 1/world, then SUM). A parameter
        that already holds a gradient (micro-batches without no_sync) has it added first, as
        AccumulateGrad adds it before DDP reads .grad, and the result replaces .grad. With two
        ranks a sum is one addition, so the result is DDP's bit for
        bit; with more, both leave the order of the sum to the backend.
Rule 4: collectives run in one fixed order on every rank, the parameters' reverse registration
        order (DDP's first buckets), not in the order backward delivers gradients (a plan's
        replays, or another shape on another rank, may change it: a mismatch would hang or sum
        different parameters). A gradient final before its turn waits on the device for it.
        A parameter this rank has no gradient for takes part with the .grad it holds, or
        zeros; when backward ends, the ranks count who used each, and one no rank used keeps
        its .grad untouched: DDP's find_unused_parameters=True.
Rule 5: no_sync() leaves out Rules 2-4 for the forwards inside it (their backwards accumulate
        locally), as DDP's does.
Rule 6: at wrap, which every rank runs once and together, the host memory check (it may
        refuse on one rank alone) is agreed on by the group: if it fails anywhere, every rank
        raises, so none waits in a collective the others left. A plan's first step is not a
        point the ranks reach together (ranks plan per input shape: a short last batch, dynamic
        padding), so its check stays local: a collective there hung ranks whose shapes differ.
"""

import contextlib

import torch
import torch.distributed as dist

# Rule 3: gradients are averaged in buckets of about this size (DDP's bucket_cap_mb default):
# one collective per bucket, not per parameter (a 10,000-layer ResNet has some 11,000)
REDUCE_BUCKET_BYTES = 25 * 2**20
# Rules 1-2: broadcasts in buckets up to this size (DDP's broadcast_bucket_size is 250 MiB): a
# bucket is one device copy, so a model larger than the device still broadcasts
BUCKET_BYTES = 256 * 2**20


def check_group(group) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("process_group= needs torch.distributed initialized "
                         "(dist.init_process_group) before sn.wrap")
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"process_group must be a torch.distributed ProcessGroup (such as "
                         f"torch.distributed.group.WORLD), not {type(group).__name__}")


def agreed(check, group, device: torch.device, what: str) -> None:
    """Rule 6: run ``check`` (it raises ValueError) on this rank; raise on every rank of
    ``group`` if it failed on any."""
    try:
        check()
        error = None
    except ValueError as failed:
        error = failed
    flag = torch.tensor([error is not None], dtype=torch.int64, device=device)
    flags = [torch.empty_like(flag) for _ in range(dist.get_world_size(group))]
    dist.all_gather(flags, flag, group=group)
    if error is not None:
        raise error
    failing = [rank for rank, other in enumerate(flags) if other.item()]
    if failing:
        raise ValueError(f"superneurons: {what} failed on rank(s) {failing} of process_group "
                         "(their error says why); every rank stops here, before any step")


class RefusesDDPOverHostState:
    """For the wrapper (module Rule 7): DistributedDataParallel around a model wrapped with
    state="host" is a ValueError before any collective, where DDP's constructor first reads
    the names it is to ignore; with the state on the device, DDP's own attribute."""

    @property
    def _ddp_params_and_buffers_to_ignore(self):
        # DistributedDataParallel's constructor reads this before any collective
        if self.state == "host":
            raise ValueError(
                "DistributedDataParallel cannot average the gradients of a model wrapped with "
                "state='host' (they reach .grad without autograd's AccumulateGrad, which DDP "
                "hooks). Pass the process group to sn.wrap instead and leave DDP out: "
                "sn.wrap(model, ..., state='host', process_group=torch.distributed.group.WORLD)"
                "; it averages as DDP does (no_sync() included)")
        if "_ddp_ignored" in self.__dict__:
            return self.__dict__["_ddp_ignored"]
        raise AttributeError("_ddp_params_and_buffers_to_ignore")

    @_ddp_params_and_buffers_to_ignore.setter
    def _ddp_params_and_buffers_to_ignore(self, names):
        self.__dict__["_ddp_ignored"] = names       # DDP's own setter, for state='device'


class DataParallel:
    """One wrapped model's data parallelism over ``group``, computing on ``device``."""

    def __init__(self, model, group, device: torch.device):
        check_group(group)
        self.model, self.group, self.device = model, group, device
        self.world = dist.get_world_size(group)
        self.require_backward_grad_sync = True     # no_sync() clears it (Rule 5)
        self.forward_sync = True                   # DDP's require_forward_param_sync (Rule 2)
        self._check_shapes()
        self._broadcast(list(model.parameters()) + list(model.buffers()))       # Rule 1

    # -- Rules 1, 2, 5 ----------------------------------------------------------------------------
    def _check_shapes(self) -> None:
        """Rule 1: the same parameters everywhere, or a ValueError on every rank (each sees
        every rank's signature, so none waits in a collective the others left)."""
        shapes = [tuple(p.shape) for p in self.model.parameters()]
        signature = torch.tensor([len(shapes), hash(tuple(shapes)) % (1 << 62)],
                                 dtype=torch.int64, device=self.device)
        everyone = [torch.empty_like(signature) for _ in range(self.world)]
        dist.all_gather(everyone, signature, group=self.group)
        if any(not torch.equal(other, everyone[0]) for other in everyone):
            raise ValueError("the ranks of process_group hold models with different parameter "
                             "shapes: build the same model on every rank")

    def _broadcast(self, tensors) -> None:
        """From the group's rank 0, in buckets of one dtype up to BUCKET_BYTES (thousands of
        running statistics are one collective, as DDP's broadcast_coalesced makes them)."""
        bucket, size = [], 0
        for tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and (tensor.dtype != bucket[0].dtype or size + nbytes > BUCKET_BYTES):
                self._broadcast_bucket(bucket)
                bucket, size = [], 0
            bucket.append(tensor)
            size += nbytes
        if bucket:
            self._broadcast_bucket(bucket)

    def _broadcast_bucket(self, bucket: list) -> None:
        """Through one device copy (NCCL takes device tensors), back to host memory at once."""
        with torch.no_grad():
            flat = torch.cat([t.detach().reshape(-1) for t in bucket]).to(self.device)
            dist.broadcast(flat, group_src=0, group=self.group)
            flat = flat.cpu()
            offset = 0
            for tensor in bucket:
                tensor.detach().copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()

    def before_forward(self, tier) -> None:
        """Rule 2, and whether this forward's backward syncs (the tier reads it per step)."""
        syncs = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self.forward_sync:
            self._broadcast(list(self.model.buffers()))
        self.forward_sync = syncs              # DDP's _post_forward
        tier.data_parallel = self if syncs else None

    @contextlib.contextmanager
    def no_sync(self):
        before = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    # -- Rules 3, 4 -------------------------------------------------------------------------------
    def begin_backward(self) -> "Round":
        order = [p for p in reversed(list(self.model.parameters())) if p.requires_grad]
        return Round(self, order)

    def local(self, host: torch.Tensor, grad) -> torch.Tensor:
        """Rule 3: this rank's part of ``host``'s gradient; ``grad`` None: it made none."""
        old = host.grad
        if grad is None:          # DDP's bucket: the .grad the parameter holds, or zeros
            return old.to(self.device) if old is not None else \
                torch.zeros(host.shape, dtype=host.dtype, device=self.device)
        return grad if old is None else old.to(self.device) + grad   # AccumulateGrad adds


class Round:
    """One synced backward's collectives, in the fixed order of Rule 4, in buckets (Rule 3)."""

    def __init__(self, parallel: DataParallel, order: list):
        self.parallel, self.order = parallel, order
        self.turn = {id(p): i for i, p in enumerate(order)}
        self.waiting: dict = {}          # position -> device gradient, final before its turn
        self.used = [0] * len(order)
        self.next = 0
        self.bucket: list = []           # (position, parameter, this rank's gradient)
        self.bucket_bytes = 0

    def ready(self, host: torch.Tensor, grad: torch.Tensor) -> list:
        """``host``'s gradient is final here; returns the (parameter, averaged gradient,
        replaces .grad) a bucket completed."""
        position = self.turn.get(id(host))
        if position is None:
            raise RuntimeError("a parameter that did not require grad when backward began got "
                               "a gradient: set requires_grad before the forward")
        self.used[position] = 1
        self.waiting[position] = grad
        done = []
        while self.next in self.waiting:
            done += self._add(self.next, self.waiting.pop(self.next))
            self.next += 1
        return [item[1:] for item in done]

    def _add(self, position: int, grad) -> list:
        """Into the bucket; a bucket is reduced once full or before one of another dtype."""
        host = self.order[position]
        local = self.parallel.local(host, grad)
        done = self._flush() if self.bucket and self.bucket[0][2].dtype != local.dtype else []
        self.bucket.append((position, host, local))
        self.bucket_bytes += local.numel() * local.element_size()
        if self.bucket_bytes >= REDUCE_BUCKET_BYTES:
            done += self._flush()
        return done

    def _flush(self) -> list:
        """Rule 3 for a bucket: times 1/world and summed over the group, as one collective."""
        bucket, self.bucket, self.bucket_bytes = self.bucket, [], 0
        if not bucket:
            return []
        flat = torch.cat([local.reshape(-1) for _, _, local in bucket])
        flat.mul_(1.0 / self.parallel.world)
        dist.all_reduce(flat, group=self.parallel.group)
        done, offset = [], 0
        for position, host, local in bucket:
            averaged = flat[offset:offset + local.numel()].view_as(local)
            done.append((position, host, averaged, host.grad is not None))
            offset += local.numel()
        return done

    def finish(self) -> list:
        """Backward ended: the parameters not reduced yet, then who used what (Rule 4); returns
        those of them some rank used."""
        start = self.next          # differs between ranks that used different parameters
        done = []
        for position in range(start, len(self.order)):
            done += self._add(position, self.waiting.pop(position, None))
        done += self._flush()
        # every rank sends the whole vector: one collective of one size everywhere
        used = torch.tensor(self.used, dtype=torch.int32, device=self.parallel.device)
        dist.all_reduce(used, group=self.parallel.group)
        counts = used.tolist()
        self.next = len(self.order)
        return [item[1:] for item in done if item[0] < start or counts[item[0]] > 0]
