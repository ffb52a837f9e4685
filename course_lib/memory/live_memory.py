"""Live tensor bytes over time: what a training step holds at every moment, and what each byte is.

    mem = cl.LiveTensorBytes(model, optimizer)   # their tensors, held before the block: the baseline
    with mem:
        mem.mark("forward");  logits = model(input_ids).logits
        mem.mark("loss");     loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        mem.mark("backward"); loss.backward()
        mem.mark("step");     optimizer.step(); optimizer.zero_grad(set_to_none=True)
    mem.peak, mem.peak_by_category(), mem.timeline(), mem.plot(ax)

A `TorchDispatchMode` sees every operation, recomputation in backward included, and counts each new tensor
storage from its creation until it is freed (a weak-reference callback on the storage), so `peak` is the
high-water mark of live tensor bytes: on a CPU a stand-in for `torch.cuda.max_memory_allocated`, anywhere the
figure a memory plan predicts. Storages resized in place (FSDP2's `storage.resize_`) are followed too. Watching
makes autograd sum a weight's gradients out of place (ZeRO-3's tied embedding, 0.5B: one 0.55 GB copy more).

Categories, by identity:
  parameters   the model's parameters (a DTensor's local shard under FSDP2, `ds_tensor` under ZeRO-3),
               and any nn.Parameter an operation reads (the full parameters FSDP2 and ZeRO-3 gather)
  gradients    their `.grad` (and DeepSpeed's gradient partitions and buckets)
  optimizer    the optimizer's state, and the master copies a wrapper steps (DeepSpeed's fp32 partitions)
  activations  what the forward pass left alive when backward began (saved tensors, checkpoint inputs)
  logits       the LM head's output, and what the loss builds from it before backward begins
  temporaries  everything else: activation gradients, recomputed activations, workspaces
  inputs       tensors no baseline named that an operation gets and returns (a view, an in-place update):
               the batch, buffers; from the start if they outlive the block (made before it), else from
               when first seen (made out of sight: ZeRO-3's reduce-scatter buffers, 1.95 GB at 0.5B)
`tag(tensor, name)` files a tensor under a category of your own. Built and drawn in chapter 03.
"""
from __future__ import annotations

import bisect
import itertools
import threading
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .measure import plain_tensors, state_tensors

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "logits", "temporaries", "inputs")
COLORS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52",
          "logits": "#8172b3", "temporaries": "#bbbbbb", "inputs": "#937860"}


class LiveTensorBytes(TorchDispatchMode):
    """Live tensor bytes inside a `with` block: `.now`, the high-water `.peak`, a timeline by category.

    model, optimizer: their tensors form the baseline (see `state_tensors`) and are re-read at every
        `mark()` and at the end, so gradients and state that appear later are filed where they belong.
    logits_module: the module whose output is the logits; "auto" takes `model.get_output_embeddings()`.
    device: count only storages on this device type ("cuda", "cpu"); None counts every device.
    extra: {category: tensors} made before the block that should count (a batch, DDP's buckets, ...).
    """

    def __init__(self, model=None, optimizer=None, logits_module="auto", device: str | None = None,
                 extra: dict | None = None):
        super().__init__()
        self.model, self.optimizer, self.device, self.extra = model, optimizer, device, extra or {}
        if logits_module == "auto":
            inner = getattr(model, "module", model)  # DDP and DeepSpeed wrap the model
            get = getattr(inner, "get_output_embeddings", None)
            logits_module = get() if get else None
        self.logits_module = logits_module
        self.now = self.peak = 0
        self.marks: list[tuple[float, int, str]] = []
        self._events: list[tuple[float, int, int]] = []  # (seconds, storage serial, byte change)
        self._baseline: dict[int, int] = {}   # serial -> bytes held before the block
        self._category: dict[int, str] = {}   # serial -> category (the last one given wins, for its whole life)
        self._bytes: dict[int, int] = {}      # serial -> current bytes, while alive
        self._live = weakref.WeakKeyDictionary()  # storage -> serial
        self._finalizers: dict[int, weakref.finalize] = {}
        self._serials = itertools.count()
        self._lock = threading.RLock()        # on a GPU, backward runs in another thread
        self._peak_at = 0                     # number of events when the peak was reached
        self._in_backward = self._in_loss = self._open = False
        self._unsure: set[int] = set()        # `inputs` first seen inside the block (`_settle`)

    # ------------------------------------------------------------------ the block
    def __enter__(self):
        self._t0 = time.perf_counter()
        self._open = True
        self._refresh(baseline=True)
        self._hooks = []
        if self.logits_module is not None:
            self._hooks.append(self.logits_module.register_forward_hook(self._on_logits))
        for p in self._parameters():
            if p.requires_grad and p.is_leaf:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self._resize = torch.UntypedStorage.resize_
        self._patched_before = "resize_" in vars(torch.UntypedStorage)  # another tracker's, when nested
        tracker = self

        # FSDP2 frees and re-allocates gathered parameters with `storage.resize_`, which no dispatch mode sees and no
        # public API reports: the method is wrapped for the block, and restored after (a patch, where nothing public is)
        def resize_(storage, nbytes):
            before = storage.nbytes()
            out = tracker._resize(storage, nbytes)
            tracker._resized(storage, before)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        if self._patched_before:
            torch.UntypedStorage.resize_ = self._resize
        else:
            del torch.UntypedStorage.resize_
        for h in self._hooks:
            h.remove()
        self._refresh()
        with self._lock:
            self._settle()
            self._open = False
            for fin in self._finalizers.values():
                fin.detach()
            self._finalizers.clear()
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._watch_backward()
        out = func(*args, **kwargs)
        with self._lock:
            for a in tree_leaves((args, kwargs)):
                if isinstance(a, torch.nn.Parameter):  # gathered FSDP2/ZeRO-3 parameters are Parameters too
                    self._file(a, "parameters")
            inputs = None
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    inputs = self._track(t, "logits" if self._in_loss else "temporaries", args, kwargs, inputs)
        return out

    def mark(self, label: str) -> None:
        """Start a named phase here (drawn as a line on the timeline); re-reads the model's state."""
        self._refresh()
        with self._lock:
            self.marks.append((time.perf_counter() - self._t0, len(self._events), label))

    def tag(self, tensor: torch.Tensor, category: str) -> None:
        """File `tensor`'s storage under `category` (a name of your own, or one of CATEGORIES)."""
        with self._lock:
            self._file(tensor, category)

    # ------------------------------------------------------------------ results
    def timeline(self) -> dict:
        """{"seconds", "total", "<category>": a point per change (bytes as filed at the end), "marks": [(s, label)]}"""
        cats = self.categories()
        level = dict.fromkeys(cats, 0)
        for serial, nbytes in self._baseline.items():
            level[self._category[serial]] += nbytes
        out = {"seconds": [0.0], "total": [sum(level.values())], **{c: [level[c]] for c in cats}}
        for seconds, serial, delta in self._events:
            level[self._category[serial]] += delta
            out["seconds"].append(seconds)
            out["total"].append(out["total"][-1] + delta)
            for c in cats:
                out[c].append(level[c])
        out["marks"] = [(seconds, label) for seconds, _, label in self.marks]
        return out

    def peak_by_category(self) -> dict[str, int]:
        """Bytes per category at the moment of the peak (they add up to `peak`)."""
        return self._levels(self._peak_at)

    def now_by_category(self) -> dict[str, int]:
        return self._levels(len(self._events))

    def phase_peaks(self) -> dict[str, int]:
        """The highest total reached in each marked phase (from one mark to the next)."""
        total = self.timeline()["total"]
        bounds = [(label, i) for _, i, label in self.marks] + [("", len(self._events))]
        return {label: max(total[i:j + 1]) for (label, i), (_, j) in zip(bounds, bounds[1:])}

    def categories(self) -> list[str]:
        return list(CATEGORIES) + sorted(set(self._category.values()) - set(CATEGORIES))

    def plot(self, ax, title: str | None = None, x: str = "events", unit: float = 2**20):
        """Draw the timeline stacked by category on a matplotlib axis, phases as dotted lines. x="events"
        spaces every allocation and free equally (short spikes stay visible); x="seconds" is wall time."""
        tl = self.timeline()
        xs = tl["seconds"] if x == "seconds" else list(range(len(tl["total"])))
        cats = [c for c in self.categories() if any(tl[c])]
        ax.stackplot(xs, [[b / unit for b in tl[c]] for c in cats], labels=cats, step="post",
                     colors=[COLORS.get(c) for c in cats])
        ax.step(xs, [b / unit for b in tl["total"]], where="post", color="k", lw=0.6)  # brief spikes stay visible
        ax.plot([xs[self._peak_at]], [self.peak / unit], "k^", ms=6)
        for seconds, index, label in self.marks:
            at = seconds if x == "seconds" else index
            ax.axvline(at, color="k", ls=":", lw=0.8)
            ax.annotate(label, (at, 1), xycoords=("data", "axes fraction"), xytext=(2, -4),
                        textcoords="offset points", fontsize=7, rotation=90, va="top")
        ax.set_xlabel("seconds" if x == "seconds" else "tensor allocations and frees, in order")
        ax.set_ylabel("live tensor MiB" if unit == 2**20 else "live tensor bytes")
        ax.set_title(title or "", fontsize=9)
        return ax

    def __repr__(self):
        return f"LiveTensorBytes(now={self.now:,} B, peak={self.peak:,} B)"

    # ------------------------------------------------------------------ bookkeeping
    def _levels(self, n_events: int) -> dict[str, int]:
        timeline = self.timeline()
        return {c: timeline[c][n_events] for c in self.categories()}

    def _parameters(self):
        engine = hasattr(self.model, "zero_optimization_stage")
        model = self.model.module if engine else self.model
        return list(model.parameters()) if model is not None else []

    def _refresh(self, baseline: bool = False) -> None:
        """Re-read the model's and optimizer's tensors: file them (and count them, if new to us)."""
        found = state_tensors(self.model, self.optimizer)
        groups = list(found.items()) + list(self.extra.items() if baseline else [])  # parameters, gradients, optimizer
        with self._lock:
            for category, tensors in groups:
                for t in tensors:
                    self._file(t, category)

    def _watch_backward(self) -> None:
        in_backward = torch._C._current_graph_task_id() != -1
        if in_backward and not self._in_backward:  # backward begins: what the forward left is activations
            with self._lock:
                for serial in list(self._bytes):
                    if self._category[serial] == "temporaries" and serial not in self._baseline:
                        self._category[serial] = "activations"
                self._in_loss = False
        self._in_backward = in_backward

    def _on_logits(self, module, inputs, output):
        if torch._C._current_graph_task_id() != -1:  # a recomputation inside backward
            return
        logits = getattr(output, "logits", output)
        if isinstance(logits, torch.Tensor):
            self.tag(logits, "logits")
            self._in_loss = True

    def _on_grad(self, param):
        if param.grad is not None:
            self.tag(param.grad, "gradients")

    def _counted(self, storage) -> bool:
        return storage.device.type != "meta" and (self.device is None or storage.device.type == self.device)

    def _storages(self, t: torch.Tensor):
        for plain in plain_tensors(t):
            try:
                storage = plain.untyped_storage()
            except (NotImplementedError, RuntimeError):  # sparse, nested: no single storage
                continue
            if self._counted(storage):
                yield storage

    def _track(self, t: torch.Tensor, category: str, args, kwargs, inputs: set | None) -> set | None:
        """Count a storage an operation produced, unless it is already counted (a view, an in-place op).
        One it got as an input was made before, out of sight: "inputs", from now (`_settle` may move it back)."""
        for storage in self._storages(t):
            serial = self._live.get(storage)
            if serial is not None:  # aten.resize_ or set_ may have changed its size
                self._set_bytes(serial, storage.nbytes())
                continue
            if inputs is None:
                inputs = {id(s) for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)
                          for s in self._storages(a)}
            if id(storage) in inputs:
                self._unsure.add(self._add(storage, "inputs"))
            else:
                self._add(storage, category)
        return inputs

    def _settle(self) -> None:
        """`inputs` that outlived the block were held before it: from the start (the peak found again) they count."""
        if kept := {s for s in self._unsure if s in self._bytes}:
            first = {e[1]: i for i, e in reversed(list(enumerate(self._events))) if e[1] in kept}  # the earliest
            self._baseline.update({serial: self._events[i][2] for serial, i in first.items()})
            drop = set(first.values())
            self._events = [e for i, e in enumerate(self._events) if i not in drop]
            self.marks = [(t, i - bisect.bisect_left(sorted(drop), i), label) for t, i, label in self.marks]
            total = self.timeline()["total"]
            self._peak_at = max(range(len(total)), key=total.__getitem__)
            self.peak = total[self._peak_at]

    def _file(self, t: torch.Tensor, category: str) -> None:
        """Give a storage its category; one we have not seen yet existed before the block: baseline."""
        for storage in self._storages(t):
            serial = self._live.get(storage)
            if serial is None:
                self._add(storage, category, held_before=storage.nbytes())
            else:
                self._category[serial] = category

    def _add(self, storage, category: str, held_before: int | None = None) -> int | None:
        """Start counting `storage`; held_before: its bytes before the block (they raise every point so far)."""
        if not self._open:
            return None
        serial = next(self._serials)
        self._live[storage] = serial
        self._category[serial] = category
        self._bytes[serial] = held_before or 0
        self._finalizers[serial] = weakref.finalize(storage, self._free, serial)
        if held_before is not None:
            self._baseline[serial] = held_before
            self.now += held_before
            self.peak += held_before
        self._set_bytes(serial, storage.nbytes())
        return serial

    def _set_bytes(self, serial: int, nbytes: int) -> None:
        delta = nbytes - self._bytes[serial]
        if delta:
            self._bytes[serial] = nbytes
            self._record(serial, delta)

    def _record(self, serial: int, delta: int) -> None:
        if not self._open:
            return
        self._events.append((time.perf_counter() - self._t0, serial, delta))
        self.now += delta
        if self.now > self.peak:
            self.peak, self._peak_at = self.now, len(self._events)

    def _resized(self, storage, before: int) -> None:
        """After `UntypedStorage.resize_` (not an operation the dispatch mode sees)."""
        with self._lock:
            if not self._counted(storage):
                return
            serial = self._live.get(storage)
            if serial is not None:
                self._set_bytes(serial, storage.nbytes())
            elif storage.nbytes() != before:  # held `before` bytes before the block, unseen until now
                self._add(storage, "temporaries", held_before=before)

    def _free(self, serial: int) -> None:
        with self._lock:
            self._finalizers.pop(serial, None)
            nbytes = self._bytes.pop(serial, 0)
            self._record(serial, -nbytes)
