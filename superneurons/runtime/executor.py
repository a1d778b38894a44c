"""The executor: runs a captured model's training step in route order, as its Plan says.

Rule 1: layers run in the route's order; each value is dropped from the forward's environment
        right after its last reader (liveness in forward; autograd does backward's), and the
        loop lets go of a layer's arguments before the room after it is made.
Rule 2: every tensor autograd saves goes through one pack hook: inside a recomputation segment
        it becomes a slot to replay; in a checkpoint layer it is matched, by storage, with the
        layer's inputs and outputs, and the plan's action for that storage decides: KEEP (stays
        as is), OFFLOAD (into the Tensor Pool), RECOMPUTE (replayed from its segment).
Rule 3: parameters and buffers are model state: saved as they are, never moved, and read from
        the model at every step.
Rule 4: on CUDA the pool's room also leaves the excess of real use over the plan (allocator
        rounding, cuDNN workspaces). The first steps read the allocator at every layer, count
        what is really allocated when that is more than the plan says (the pool's entries and
        the planned pool tensors no layer has saved yet are the plan's), and calibrate the
        excess: the largest seen, in bytes, is added at every step (calibration.py; a ratio
        would scale a workspace measured beside a small step up to every large one: 3.3x once,
        budget_margin.json). Later steps trust the calibration (a reading costs host time
        comparable to a small layer's kernels: profile_before.json), until an out-of-memory
        retry calls for calibrating again; a step whose peak passed the budget between the
        readings adds what it passed to the excess, once (untouched.py Rule 5). Before the
        first calibration, and always where the allocator keeps no statistics (no caching
        allocator), real use is taken as FIRST_STEP_MARGIN times the plan.
Rule 5: a layer that runs out of device memory gets one retry after everything that may leave
        the device has left; a second failure is the caller's clear error. In backward the same
        holds for bringing a saved tensor back (a fetch or a replay); autograd's own kernels
        are beyond reach. The retry is exact because PyTorch's layers allocate their results
        before they write anything (a layer that updated a buffer and then failed would
        update it twice).
Rule 6: the pool makes a backward step's room when that step reads a pool tensor, and at the
        backward of a layer with scratch (capture/scratch.py), whatever it reads: that step
        holds bytes no earlier step did (AlexNet b1620's LRN1 ran at POOL1's accounting and went
        out of memory). Entering every step was tried: ResNet-50 b280 then moved 1.62 GiB a step
        at 1455 img/s, where entering pool steps alone had moved nothing at 1786 (another host;
        speed_resnet50_280_steps.json, speed.json): the calibrated excess, which holds cuDNN
        workspaces that shrink to fit, was added at steps inside whole-block replays.
Rule 7: a saved tensor written in place after it was saved is refused when backward reads it,
        as autograd refuses it where no hooks are set (with them it does not check): whether
        kept, moved or replayed, the step would otherwise read other values than plain
        PyTorch's, or refuse nothing where it refuses.
Rule 8: in forward, after the room for the next layer is made, the copies that the room of the
        layers after it will need are started now (pool Rule 6), as far ahead as their bytes
        take to cross the link at the plan's layer times (costs.work, on the measured machine):
        made at the step that needs it, that room waited for its copies, and the device idled.
Rule 9: on CUDA, while the plan calibrates, and at every step once one passed the budget
        (calibration.py's passed()), each convolution (its forward, replays and backward) runs
        with the allocator limited to the room the budget leaves beside it, so that the cuDNN
        engines PyTorch chooses and keeps have workspaces that fit (workspaces.py): they would
        otherwise take what the device allows. After a pass every step is fitted, a safety
        net: later steps of ResNet-101 at batch 896 passed the budget by 120 MiB in 4 of 8
        steps and held in 5 of 5 fitted (claims_resnet101_896_8_steps.json,
        ab_calibration_resnet101_896.json), not for their engines: a fit waits for the
        device when it returns cached blocks, so the offloads beside it finish, and a trusting
        step met them in flight (Rule 10 frees those first now). Not at every step from
        the first: a fitted step of DenseNet-201 at batch 783 took 3.2-3.3 s, one running the
        engines kept 2.0 (claims_fit_every_step.json, claims_e25bb48.json). A forward or
        replayed one that runs out of memory under its limit is retried without it (Rule 5's
        retry), and the calibration is not made again for it: the limit failed, not the plan.
        A backward one's out-of-memory is autograd's, beyond reach (Rule 5). Never under
        deterministic kernels: an engine chosen within less memory may round otherwise.
Rule 10: on CUDA, a convolution of a step that trusts its calibration runs beside no more pool
        bytes than it had when last fitted (Rule 9): the offloads in flight past that are freed
        first, oldest first, behind waits of the compute stream for their copies (pool Rule 4),
        not of the host. PyTorch keeps the engine fitted beside a pool whose earlier copies had
        finished (a fit waits for the device when it returns cached blocks); a step whose host
        runs ahead finds them unfinished, the pool holds their bytes within its room, and the
        kept engine's workspace takes that room again: ResNet-101 at batch 896 passed its
        budget by 120 MiB in every trusting step, and held it with every copy in flight freed
        before each convolution (diagnose_trusting_peak_resnet101_896_unpaced_3fc19e0.json,
        ..._drain_unpaced_3fc19e0.json); so did every claim of the README, on every step
        (claims_nine_h100_d2c2538.json). Waiting on the host before forward layers held them
        too, but idled the device while the host prepared each layer.
"""

import logging
import operator
import weakref

import torch
from torch import fx
from torch.autograd.graph import saved_tensors_hooks
from torch.utils import _pytree as pytree

from ..capture.kinds import Kind
from ..planner import Action
from .handles import PoolRef
from .calibration import Calibration
from .outside import OutsideGradients
from .pool import TensorPool
from .room import RangeMax, RoomKeeping, allocator_counts, foreign_bytes
from .saved import SavedTensors
from .replay import SegmentRecord, blind_state, capture_autocast, capture_rng, \
    replayed_random, restored_buffers, stand_in
from .state import StateTier
from .workspaces import FitOutOfMemory, WorkspaceFit, fits_on, grad_bytes


log = logging.getLogger(__name__)   # INFO: a calibrating step is slower (Rule 4); the CLI says so


def _getter(owner, dotted: str):
    """A function reading ``owner``'s attribute at the dotted path now, as attrgetter would,
    through the modules' own tables (nn.Module.__getattr__ searches three of them per level,
    per call): the user may replace a submodule (a new head) as well as a tensor."""
    *path, name = dotted.split(".")

    def read():
        obj = owner
        for part in path:
            modules = getattr(obj, "_modules", None)
            obj = modules[part] if modules is not None and part in modules else \
                getattr(obj, part)
        if isinstance(obj, torch.nn.Module):
            if name in obj._parameters:
                return obj._parameters[name]
            if name in obj._buffers:
                return obj._buffers[name]
        return getattr(obj, name)
    return read


def _has_path(obj, dotted: str) -> bool:
    try:
        operator.attrgetter(dotted)(obj)
        return True
    except AttributeError:
        return False


def _never(_):
    raise RuntimeError("a tensor saved during a superneurons replay was read; please report this")


class Executor(RoomKeeping, SavedTensors):
    def __init__(self, plan, device: torch.device, budget_bytes: int, count_foreign: bool = True,
                 model=None, callers_budget_bytes: int | None = None):
        self.plan, self.device, self.budget_bytes = plan, device, budget_bytes
        # the budget the caller gave, which messages name: a trial may keep an executor below
        # it (trial.py Rule 7)
        self.callers_budget_bytes = budget_bytes if callers_budget_bytes is None \
            else callers_budget_bytes
        self.cuda = device.type == "cuda"
        # a user's budget covers all device memory (optimizer state, other tensors); the
        # policy's own floor covers only what the plan knows
        self.count_foreign = count_foreign
        self.foreign_bytes = 0
        self.calibration = Calibration(device, budget_bytes)                 # Rule 4
        self.workspaces = WorkspaceFit(device, budget_bytes, self.calibration.slack) \
            if fits_on(device) and count_foreign else None                  # Rule 9
        self.unfitted = False      # Rule 9: a retry after an out-of-memory under the fit
        self.calibrating = False
        self.fitted_beside: dict = {}   # Rule 10: (layer, forward) -> pool bytes at its fit
        self.reads_allocator = None          # known at the first step (allocator_counts)
        graph = plan.graph
        self.graph, self.gm = graph, graph.graph_module
        # model state is read from the model itself at every step (Rule 3): the user may have
        # replaced a tensor since capture (model.double().float(), load_state_dict(assign=True))
        self.model = self.gm if model is None else model
        self._read_state()
        self.num_layers = len(plan.order)
        # read per saved tensor (saved.py): looked up once here
        self.storage_of_value = [v.storage for v in graph.values]
        self.last_forward_use = [plan.timeline.last_forward_use(s)
                                 for s in range(len(graph.storages))]
        self.segment_of = {l: s for s in plan.segments for l in s.layers}
        self._liveness(graph)
        self._replay_liveness(graph)
        self.unmanaged = plan.unmanaged_per_step()
        self.pool_created = plan.managed_created_per_step()
        self.pool_live = plan.managed_live_per_step()                         # Rule 8
        self.forward_rooms = None    # Rules 1 and 8: room.py's tables, made again when the
        # calibration changes (their key)
        self.work_before = [0.0]     # Rule 8: the plan's seconds of the route's first k layers
        for layer in plan.order:
            self.work_before.append(self.work_before[-1] + plan.costs.work[layer])
        # planned pool storages a layer's outputs hold: on the device from that layer on, but
        # an entry only once a layer saves them (an output the next layer saves, a branch's
        # output the join saves): until then the pool's room and the calibration count them
        # apart, for as long as the forward's environment holds them (Rule 4)
        managed = {b.storage: b.nbytes for b in plan.buffers
                   if b.managed and b.storage is not None}
        self.pool_storages_of = {}         # fx node -> ((storage, bytes), ...)
        for layer in graph.layers:
            held = {graph.values[v].storage for v in layer.outputs} & managed.keys()
            if held:
                self.pool_storages_of[layer.node] = tuple((s, managed[s]) for s in held)
        self.holders: dict = {}            # storage -> nodes of the environment holding it
        self.awaiting: dict = {}           # storage -> bytes, made for the pool, not entries yet
        self.unmanaged_max = RangeMax(self.unmanaged)
        self.scratch_steps = {self.bwd(l.index) for l in graph.layers if l.backward_scratch}
        this = weakref.ref(self)       # the pool must not keep its executor alive
        self.pool = TensorPool(device, lambda step, until=None: this().allowance(step, until),
                               plan.costs.machine.pool_bytes)               # pool Rule 5
        # model state in host memory, streamed per layer (state.py), where the plan says so
        self.tier = StateTier(self.model, device, self.pool.mover) if plan.state == "host" \
            else None
        self.step_id = 0
        self.layer = self.segment = self.replaying = self.backward_step = None
        self.records: dict = {}
        self.every_record = weakref.WeakSet()  # of every step whose handles may live (in_flight)
        self.pending: list = []
        self.stand_ins: dict = {}        # batch norms' buffers for replays (replay.py Rule 2)
        self._reset_stats()

    def _reset_stats(self) -> None:
        """What StepStats reports is the last step's alone."""
        pool = self.pool
        pool.offloaded_bytes = pool.prefetched_bytes = pool.cache_hits = pool.cache_misses = 0
        pool.host_memory.taking_seconds = self.calibration.seconds = 0.0
        self.recomputed_layers = self.accounted_peak = self.drained_convolutions = 0

    def _read_state(self) -> None:
        """Rule 3: the model's state as it is now, in one pass over its modules: its parameters
        (whose gradients foreign_bytes counts), the storages of its parameters and buffers (the
        pack hook's), and each by its dotted name (get_attr nodes read them: _state)."""
        named, parameters = {}, {}
        for prefix, module in self.model.named_modules():
            dot = prefix + "." if prefix else ""
            for name, tensor in module._parameters.items():
                if tensor is not None:
                    named[dot + name] = parameters[id(tensor)] = tensor
            for name, tensor in module._buffers.items():
                if tensor is not None:
                    named[dot + name] = tensor
        self.parameters = list(parameters.values())      # model.parameters()'s order
        self.param_ptrs = {t.untyped_storage().data_ptr() for t in named.values()}
        self.named_state = named

    def _liveness(self, graph) -> None:
        """Rule 1: after which route position each fx node's value can be dropped."""
        position = {graph.layers[i].node: p for p, i in enumerate(self.plan.order)}
        last = {}
        for node in self.gm.graph.nodes:
            for user in node.users:
                if user.op == "output":
                    last[node] = self.num_layers      # returned: never dropped
                elif user in position:
                    last[node] = max(last.get(node, -1), position[user])
        self.free_after = [[] for _ in range(self.num_layers + 1)]
        for node, at in last.items():
            self.free_after[at].append(node)
        self.placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        self.input_node = dict(zip(graph.input_values, graph.input_nodes))
        self.attrs = [n for n in self.gm.graph.nodes if n.op == "get_attr"]
        # whose attribute each get_attr reads: the model's own tensors by their names (read
        # again every step), else the graph's (constants, the bodies of grad-mode and autocast
        # regions); decided once, not by an exception per node and step
        self.state_getter = {
            node: _getter(self.model if _has_path(self.model, node.target) else self.gm,
                          node.target)
            for node in self.attrs}
        self.output = next(n for n in self.gm.graph.nodes if n.op == "output")
        self.outside = OutsideGradients(graph)

    def _replay_liveness(self, graph) -> None:
        """What each segment's replays read, and after which position a replay may drop a value."""
        self.replay_inputs = self.plan.replay_inputs()
        self.segment_free_after = {}   # segment -> position -> nodes a replay may drop there
        self.segment_position = {}     # segment -> layer -> its position in the segment
        self.segment_state = {}        # segment -> get_attr nodes its layers read
        self.segment_copied = {}       # segment -> those some layer writes, copied for replays
        self.segment_blind = {}        # segment -> those written that replays read stand-ins of
        self.mutable_state = {n for layer in graph.layers for n in layer.state_writes}
        for segment in self.plan.segments:
            self.segment_state[segment.index] = list(dict.fromkeys(
                n for l in segment.layers for n in graph.layers[l].node.all_input_nodes
                if n.op == "get_attr"))
            written = [n for n in self.segment_state[segment.index] if n in self.mutable_state]
            # with state on the host a replay writes only its own copies (state.py Rule 4)
            blind = set() if self.plan.state == "host" else \
                blind_state(written, [graph.layers[l].node for l in segment.layers])
            self.segment_copied[segment.index] = [n for n in written if n not in blind]
            self.segment_blind[segment.index] = blind
            self.segment_position[segment.index] = {l: p for p, l in enumerate(segment.layers)}
            inside = {graph.layers[l].node: p for p, l in enumerate(segment.layers)}
            uses = {}
            for node, p in inside.items():
                for arg in node.all_input_nodes:
                    uses[arg] = max(uses.get(arg, -1), p)
            free = [[] for _ in segment.layers]
            for node, p in uses.items():
                free[p].append(node)
            self.segment_free_after[segment.index] = free

    def bwd(self, layer_index: int) -> int:
        return 2 * self.num_layers - 1 - self.plan.timeline.position[layer_index]

    # -- forward -------------------------------------------------------------------------------
    def run(self, args: list, foreign: int | None = None):
        """One forward from the graph's flat inputs (placeholders in order); the output as the
        model returns it. ``foreign``: the device bytes the model does not own, where the
        caller has just read them (module Rule 3), else read here."""
        self.step_id += 1
        self._reset_stats()
        if self.tier is not None:      # first: it may pin the state anew (to_host_memory)
            self.tier.begin_step([self._named_state(name)
                                  for name in self.plan.resident_state])
        self._read_state()
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self.records, self.pending, self.awaiting, self.holders = {}, [], {}, {}
        self.backward_step = None      # step numbers repeat every training step
        self.autocast = capture_autocast(self.device)
        if self.cuda and self.reads_allocator is None:
            self.reads_allocator = allocator_counts(tensors)
        if self.cuda and self.reads_allocator:
            # resident copies are none here: begin_step above dropped any left (state Rule 7)
            self.foreign_bytes = foreign if foreign is not None else foreign_bytes(
                self.graph, tensors, self.device, self.parameters,
                state_on_device=self.tier is None)
            self.calibrating = self.calibration.begin_step()
            if self.calibrating:
                self.fitted_beside = {}                                    # Rule 10
                log.info("step %d of this plan: calibrating (reading device memory at every "
                         "layer)", self.step_id)
        self.outside.begin()                                    # outside.py Rule 3
        env = dict(zip(self.placeholders, args))
        for node in self.attrs:
            env[node] = self._state(node)
        with saved_tensors_hooks(self._pack, self._unpack):
            for position, layer_index in enumerate(self.plan.order):
                layer = self.graph.layers[layer_index]
                segment = self.segment_of.get(layer_index)
                if segment is not None and segment.layers[0] == layer_index:
                    self.records[segment.index] = self._new_record(segment, env)
                self.layer, self.segment, self.counter = layer, segment, 0
                call_args, kwargs, inputs = self._load(layer.node, env, trains=True)
                if self.tier is not None and position + 1 < self.num_layers:
                    self.tier.prefetch_layer(self.graph.layers[self.plan.order[position + 1]],
                                             env, self.mutable_state)
                try:
                    out = self._call(layer, call_args, kwargs, trains=True)
                except torch.OutOfMemoryError as error:   # Rule 5: evict all that may go,
                    self._after_out_of_memory(error, position, forward=True)   # retry once
                    self.pending, self.counter = [], 0
                    try:
                        out = self._call(layer, call_args, kwargs, trains=True)
                    finally:
                        self.unfitted = False
                env[layer.node] = self.outside.inside(layer.node, out)
                self._env_holds(layer.node)
                if self.tier is not None:
                    self.tier.end_layer(layer.node, out)
                if self.pending:
                    self._resolve(layer, position, inputs, out)
                # the room made below counts the inputs this layer read last as gone: a local
                # reference would keep them on the device through the next layer
                call_args = kwargs = inputs = out = None
                for node in self.free_after[position]:
                    if env.pop(node, None) is not None:
                        self._env_drops(node)
                # room for the next layer: what only this layer read may leave now
                awaiting = self._awaiting_bytes()    # making room adds no entries: once
                limit = self._room_for_next(position, awaiting)
                self.pool.make_room(position + 1, forward=True, limit=limit)
                self._offload_ahead(position, awaiting)                     # Rule 8
                self._account(position, awaiting)
        self.layer = self.segment = None
        self.awaiting, self.holders = {}, {}      # what no layer saved is not the pool's
        if self.tier is not None:
            self.tier.end_forward()
        for record in self.records.values():
            record.sealed = True
            if not record.alive:
                record.inputs = None
        out = fx.node.map_arg(self.output.args[0],
                              lambda node: self.outside.returned(env[node]))
        self.outside.begin()               # what the output did not name (outside.py Rule 3)
        if self.graph.out_spec is not None:                 # an exported graph's flat outputs
            return pytree.tree_unflatten(list(out), self.graph.out_spec)
        return out

    def _load(self, node: fx.Node, env: dict, trains: bool = False):
        """The layer's arguments from ``env``, and its tensor inputs (not model state). With
        state on the host, model state comes as device copies (state.py Rule 1); ``trains``:
        their gradients go to the parameters (a forward, not a replay)."""
        inputs = []
        tier = self.tier
        if tier is not None:
            tier.begin_layer()

        def fetch(arg):
            obj = env[arg]
            if not isinstance(obj, torch.Tensor):
                return obj
            if arg.op != "get_attr":
                inputs.append(obj)
                if tier is not None:
                    tier.read_input(arg, obj)
                return obj
            if tier is None:
                return obj
            return tier.fetch_for_layer(obj, trains, trains and arg in self.layer.state_writes)
        return fx.node.map_arg(node.args, fetch), fx.node.map_arg(node.kwargs, fetch), inputs

    def _call(self, layer, args, kwargs, trains: bool = False):
        if layer.kind is not Kind.CONV or self.workspaces is None or self.unfitted:
            return self._run_layer(layer, args, kwargs, trains)
        key = (layer.index, trains)          # a forward, or a replay (in backward)
        if not (self.calibrating or self.calibration.raised):
            fitted_beside = self.fitted_beside.get(key)                    # Rule 10
            if fitted_beside is not None and self.pool.drain_to(fitted_beside):
                self.drained_convolutions += 1
            return self._run_layer(layer, args, kwargs, trains)
        graph = self.graph                                                 # Rule 9
        output_bytes = [graph.storages[graph.values[v].storage].nbytes for v in layer.outputs]
        try:
            with self.workspaces.fitted(output_bytes):
                self.pool.free_finished()          # the limit may have waited for copies
                self.fitted_beside[key] = min(self.pool.device_bytes,
                                              self.fitted_beside.get(key, self.pool.device_bytes))
                out = self._run_layer(layer, args, kwargs, trains)
        except torch.OutOfMemoryError as error:
            raise FitOutOfMemory(str(error)) from error
        if trains:
            # its gradients (a module's own parameters are not among the arguments)
            tensors = pytree.tree_leaves((args, kwargs))
            if layer.module is not None:
                tensors += list(layer.module.parameters())
            self.workspaces.through_backward(out, grad_bytes(tensors))
        return out

    def _run_layer(self, layer, args, kwargs, trains: bool):
        node = layer.node
        if node.op == "call_module":
            if self.tier is not None:
                with self.tier.module_on_device(layer.module, trains):
                    return layer.module(*args, **kwargs)
            return layer.module(*args, **kwargs)
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        self_obj, *rest = args
        return getattr(self_obj, node.target)(*rest, **kwargs)

    # -- recomputation ---------------------------------------------------------------------------
    def _new_record(self, segment, env: dict) -> SegmentRecord:
        inputs = {}
        first_need = self.bwd(segment.layers[-1])
        for value in self.replay_inputs[segment.index]:
            producer = self.graph.values[value].producer
            node = self.input_node[value] if producer is None else self.graph.layers[producer].node
            obj = env[node]
            storage = self.graph.values[value].storage
            if isinstance(obj, torch.Tensor) and self.plan.actions[storage] is Action.OFFLOAD:
                obj = self._pool_ref(storage, obj, first_need, obj.requires_grad)
            inputs[node] = obj
        random = any(self.graph.layers[l].random for l in segment.layers)
        rng = capture_rng(self.device) if random else None
        state = {node: self._state(node).detach().clone()
                 for node in self.segment_copied[segment.index]}
        record = SegmentRecord(self, segment, inputs, rng, self.autocast, state)
        self.every_record.add(record)
        return record

    def _state(self, node: fx.Node):
        """A get_attr node's object: the model's parameter or buffer of that name as this step
        read it (_read_state), else read from its owner now (state_getter: a shared module's
        second name, a plain tensor attribute, the graph's constants)."""
        tensor = self.named_state.get(node.target)
        return tensor if tensor is not None else self.state_getter[node]()

    def _named_state(self, name: str) -> torch.Tensor:
        """The state tensor the plan names (planner/state.py), read now as _state reads: the
        model's own, else the graph's (constants)."""
        return operator.attrgetter(name)(self.model if _has_path(self.model, name) else self.gm)

    def replay(self, record: SegmentRecord, last: int, wanted: set) -> None:
        """Run ``record``'s segment again up to position ``last``, keeping the ``wanted`` keys."""
        segment = record.segment
        # model state as the segment's forward read it: written-in-place state from the
        # record's copy (a copy again, so the replay's own writes touch neither), or a stand-in
        # where no output depends on it (replay.py Rule 2), the rest as is
        blind = self.segment_blind[segment.index]
        env = {node: record.state[node].clone() if node in record.state else
               stand_in(node, self._state(node), self.stand_ins) if node in blind else
               self._state(node)
               for node in self.segment_state[segment.index]}
        for node, holder in record.inputs.items():
            if isinstance(holder, PoolRef):
                self._enter_backward_step(holder.step)
                tensor = holder.get().detach()
                env[node] = tensor.requires_grad_(holder.requires_grad)
            elif isinstance(holder, torch.Tensor):
                env[node] = holder.detach().requires_grad_(holder.requires_grad)
            else:
                env[node] = holder
        layers = [self.graph.layers[l] for l in segment.layers[:last + 1]]
        # with state on the host a replay writes only its own copies (state.py Rule 4)
        modules = [] if self.tier is not None else \
            [l.module for l in layers if l.module is not None]
        free_after = self.segment_free_after[segment.index]
        kind, enabled, dtype = record.autocast
        # the values a checkpoint layer after the segment reads (ValueRef): few layers make one
        wanted_values = {key[1] for key in wanted if key[0] == "value"}
        self.replaying = (record, wanted)
        try:
            with torch.enable_grad(), restored_buffers(modules, self.stand_ins), \
                    replayed_random(record.rng, self.device), \
                    torch.autocast(kind, dtype=dtype, enabled=enabled), \
                    saved_tensors_hooks(self._capture, _never):
                for position, layer in enumerate(layers):
                    self.replay_layer, self.replay_counter = layer.index, 0
                    args, kwargs, inputs = self._load(layer.node, env)
                    out = self._call(layer, args, kwargs)
                    env[layer.node] = out
                    if self.tier is not None:
                        self.tier.end_layer(layer.node, out)
                    if not wanted_values.isdisjoint(layer.outputs):
                        outputs = [t for t in pytree.tree_leaves(out)
                                   if isinstance(t, torch.Tensor)]
                        for tensor, value in zip(outputs, layer.outputs):
                            if value in wanted_values:
                                record.cache["value", value] = tensor.detach()
                    args = kwargs = inputs = out = outputs = tensor = None   # as in forward
                    for node in free_after[position]:
                        if node not in record.inputs:
                            env.pop(node, None)
        finally:
            self.replaying = None
        self.recomputed_layers += len(layers)

    def _capture(self, tensor: torch.Tensor):
        record, wanted = self.replaying
        key = (self.replay_layer, self.replay_counter)
        self.replay_counter += 1
        if key in wanted:
            record.cache[key] = tensor.detach()
        return None

    def release(self) -> None:
        self.records, self.pending = {}, []
        self.pool.clear()
        if self.tier is not None:
            # state copies fetched for a layer that never ran, and resident ones (state Rule 7)
            self.tier.release()

    # -- lifetime (module Rule 5) ----------------------------------------------------------------
    @property
    def in_flight(self) -> bool:
        """Whether handles of a step are alive (autograd's graph, an output the caller keeps):
        they read the pool's entries and the segments' records. Gradient accumulation keeps
        several steps' handles, so every record counts, not only the last step's."""
        return bool(self.pool.entries) or any(record.alive for record in self.every_record)

    def close(self) -> None:
        """Give back all the executor holds between steps: the pool's entries, its host memory
        (pinned chunks), its copies' events. Refused while a step is in flight (its handles
        read them): the module closes such an executor once they are gone."""
        if self.in_flight:
            raise RuntimeError("a superneurons executor was closed with a step in flight; "
                               "please report this")
        self.release()
        self.every_record = weakref.WeakSet()
        self.pool.close()
