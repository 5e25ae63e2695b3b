"""Rendering forward/forward_async from the real signature, without any RPC."""

import inspect
import types

import pytest
import torch
from torch.futures import Future

from remote_module._codegen import forward_signature, render_forward_methods, template_text
from tests._remote import Affine, VarArgs


class Recorder:
    """Stands in for a proxy: records what the generated methods would send."""

    def __init__(self):
        self.sent = []

    def _remote_call_sync(self, args, kwargs):
        self.sent.append(("sync", args, kwargs))
        return "result"

    def _remote_call_async(self, args, kwargs):
        self.sent.append(("async", args, kwargs))
        fut = Future()
        fut.set_result("result")
        return fut


def bind(module_cls):
    rec = Recorder()
    fwd, fwd_async = render_forward_methods(forward_signature(module_cls), module_cls.__qualname__)
    return rec, types.MethodType(fwd, rec), types.MethodType(fwd_async, rec)


@pytest.mark.parametrize("module_cls", [Affine, VarArgs, torch.nn.Linear, torch.nn.EmbeddingBag, torch.nn.MultiheadAttention])
def test_signature_is_the_modules(module_cls):
    _, fwd, fwd_async = bind(module_cls)
    expected = inspect.signature(module_cls.forward)
    expected = expected.replace(parameters=list(expected.parameters.values())[1:])
    assert inspect.signature(fwd) == expected
    async_sig = inspect.signature(fwd_async)
    assert list(async_sig.parameters.values()) == list(expected.parameters.values())
    assert async_sig.return_annotation is not inspect.Signature.empty
    ann = async_sig.return_annotation
    assert ann is Future or getattr(ann, "__origin__", None) is Future


def test_defaults_and_keywords_are_bound_on_the_caller():
    rec, fwd, fwd_async = bind(Affine)
    x = torch.ones(1)
    assert fwd(x) == "result"
    fwd(x, 2.0, shift=x)
    assert fwd_async(x, scale=3.0).wait() == "result"
    assert rec.sent[0] == ("sync", (x, 1.0), {"shift": None})
    assert rec.sent[1] == ("sync", (x, 2.0), {"shift": x})
    assert rec.sent[2] == ("async", (x, 3.0), {"shift": None})


def test_var_positional_keyword_and_positional_only():
    rec, fwd, _ = bind(VarArgs)
    fwd(1, 2, 3, 4, c=5, d=6)
    assert rec.sent == [("sync", (1, 2, 3, 4), {"c": 5, "d": 6})]
    with pytest.raises(TypeError):
        fwd(a=1, b=2)  # a is positional-only


@pytest.mark.parametrize(
    "call",
    [
        lambda f: f(),  # missing x
        lambda f: f(torch.ones(1), 1.0, 2.0),  # too many positional
        lambda f: f(torch.ones(1), nope=1),  # unknown keyword
        lambda f: f(torch.ones(1), torch.ones(1), scale=2.0),  # scale twice
    ],
)
def test_wrong_arguments_fail_locally_and_send_nothing(call):
    rec, fwd, fwd_async = bind(Affine)
    for f in (fwd, fwd_async):
        with pytest.raises(TypeError):
            call(f)
    assert rec.sent == []


def test_unknown_signature_falls_back_to_varargs():
    rec = Recorder()
    fwd, _ = render_forward_methods(None, "opaque")
    sig = inspect.signature(fwd)
    assert [p.kind for p in sig.parameters.values()][1:] == [
        inspect.Parameter.VAR_POSITIONAL,
        inspect.Parameter.VAR_KEYWORD,
    ]
    types.MethodType(fwd, rec)(1, k=2)
    assert rec.sent == [("sync", (1,), {"k": 2})]


def test_generated_source_is_readable():
    _, fwd, _ = bind(Affine)
    src = inspect.getsource(fwd)
    assert "def forward(_rm_self, x: _rm_a0, scale: _rm_a1 = _rm_d1, *, shift: _rm_a2 = _rm_d2)" in src
    assert "templates/forward.py.tpl" in template_text("forward.py.tpl")


def test_parameter_names_that_would_clash_are_rejected():
    sig = inspect.Signature([inspect.Parameter("_rm_self", inspect.Parameter.POSITIONAL_OR_KEYWORD)])
    with pytest.raises(ValueError, match="_rm_self"):
        render_forward_methods(sig, "Clash")
