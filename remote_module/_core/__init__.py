"""The machinery every layer of remote_module may use, through the names listed here.

Upper layers (the proxy in ``remote_module._proxy`` and ``remote_module.remote_module``, and
``pipeline``, ``sharded``, ``ps``) import these names from ``remote_module._core`` itself,
never from its modules: what is listed in ``__all__`` is the internal API, and
``tests/test_layers.py`` fails when a layer reaches past it. What lives where:

- ``deadlines``: timeouts normalised once (:func:`timeout_seconds`), torch's timeout
  argument written once (:func:`rpc_timeout_argument`), program order kept before a layer
  calls proxies' hosts by other means (:func:`wait_for_earlier_calls`);
- ``fanout``: N host calls at once (:func:`call_all`, :func:`call_all_async`,
  :func:`call_async`; :func:`send_to_each` for calls a layer checked once; :func:`call_grouped`:
  one message per worker, :func:`call_grouped_each_async` with each call's outcome, later;
  :func:`call_one`: one call whose answer holds no RRef, waited for in
  the calling thread), nested budgets
  (:func:`nested_seconds`, :func:`answer_margin`), :func:`send_and_forget`;
- ``answers``: the futures of the calls ``fanout`` sent, settled by answer or deadline;
- ``settling``: settling futures off the RPC threads and the one deadline watcher;
- ``errors``: :class:`RemoteModuleError`, :class:`CallTimeout`, remote tracebacks, retyping;
- ``device``: parsing ``remote_device``, moving tensors to and from the host's device;
- ``walk``: mapping over nested tuples, lists and dicts (and :func:`parameters_as_views`);
- ``store``: the host object store (:data:`host_objects`, :func:`hosted_module`);
- ``untrained``: the warning for a remote forward that distributed autograd cannot train;
- ``_torch_private``: every use of torch's private names, in one file;
- argument checks shared with ``rpc_backend`` (:func:`positive_int`, :func:`positive_seconds`),
  and its one-time check that a peer runs this build (:func:`check_peer`, called at the first
  call to each peer: in ``fanout`` and by the proxy; :func:`peer_checked` is its set lookup).
"""

from remote_module._core._torch_private import (
    as_python_module,
    backward_accumulates,
    before_rref_deletion_at_shutdown,
    dcp_storage_info,
    device_map_to,
    dist_autograd_contexts_exist,
    embedding_bag_parts,
    global_optimizer_step_hooks,
    in_dist_autograd_context,
    in_torch_save,
    interface_forward_schema,
    is_jit_interface,
    is_rpc_initialized,
    post_accumulate_grad_hooks,
    profiler_enabled,
    register_rpc_reducer,
    rpc_class_reducers,
    rref_types,
    save_without_record_crc,
    script_class_name,
    script_module_has_attribute,
    storage_address,
    worker_names,
)
from remote_module._core.deadlines import (
    agent_timeout_seconds,
    rpc_timeout_argument,
    timeout_seconds,
    wait_for_earlier_calls,
)
from remote_module._core.device import (
    move_cpu_tensors,
    parse_remote_device,
    prepare_inputs,
    prepare_output,
    tensors_to_cpu,
    uses_device_map,
)
from remote_module._core.errors import (
    CallTimeout,
    RemoteFailure,
    RemoteModuleError,
    capture,
    on_machine,
    retyped,
    timeout_message,
    to_exception,
    unsendable_argument,
)
from remote_module._core.fanout import (
    HostCall,
    answer_margin,
    call_all,
    call_all_async,
    call_async,
    call_grouped,
    call_grouped_async,
    call_grouped_each,
    call_grouped_each_async,
    call_one,
    nested_seconds,
    send_and_forget,
    send_to_each,
    wait_plain,
)
from remote_module._core.settling import (
    WATCH_TICK_S,
    add_to_run,
    complete,
    finish_run,
    followed,
    schedule,
    settle_elsewhere,
    settle_here,
    watched_run,
)
from remote_module._core.store import HostStore, host_device, host_objects, hosted_module
from remote_module._core.untrained import records_outside_context, unwarned_state, user_stacklevel, warn_untrained
from remote_module._core.walk import map_leaves, map_tensors, parameters_as_views
from rpc_backend.builds import check_peer, peer_checked
from rpc_backend.options import positive_int, positive_seconds

__all__ = [
    "WATCH_TICK_S",
    "CallTimeout",
    "HostCall",
    "HostStore",
    "RemoteFailure",
    "RemoteModuleError",
    "add_to_run",
    "agent_timeout_seconds",
    "answer_margin",
    "as_python_module",
    "backward_accumulates",
    "before_rref_deletion_at_shutdown",
    "call_all",
    "call_one",
    "call_all_async",
    "call_async",
    "call_grouped",
    "call_grouped_async",
    "call_grouped_each",
    "call_grouped_each_async",
    "capture",
    "check_peer",
    "peer_checked",
    "complete",
    "dcp_storage_info",
    "save_without_record_crc",
    "device_map_to",
    "dist_autograd_contexts_exist",
    "embedding_bag_parts",
    "finish_run",
    "followed",
    "global_optimizer_step_hooks",
    "host_device",
    "host_objects",
    "hosted_module",
    "in_dist_autograd_context",
    "in_torch_save",
    "interface_forward_schema",
    "is_jit_interface",
    "is_rpc_initialized",
    "map_leaves",
    "map_tensors",
    "move_cpu_tensors",
    "nested_seconds",
    "parameters_as_views",
    "parse_remote_device",
    "positive_int",
    "positive_seconds",
    "post_accumulate_grad_hooks",
    "prepare_inputs",
    "prepare_output",
    "profiler_enabled",
    "records_outside_context",
    "register_rpc_reducer",
    "on_machine",
    "retyped",
    "rpc_class_reducers",
    "rpc_timeout_argument",
    "rref_types",
    "schedule",
    "script_class_name",
    "script_module_has_attribute",
    "send_and_forget",
    "send_to_each",
    "settle_elsewhere",
    "settle_here",
    "storage_address",
    "timeout_message",
    "timeout_seconds",
    "to_exception",
    "tensors_to_cpu",
    "unsendable_argument",
    "unwarned_state",
    "user_stacklevel",
    "uses_device_map",
    "wait_for_earlier_calls",
    "wait_plain",
    "warn_untrained",
    "watched_run",
    "worker_names",
]
