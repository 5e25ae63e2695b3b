"""Rendering forward/forward_async from the real signature, without any RPC."""

import inspect
import types

import pytest
import torch
from torch.futures import Future

from remote_module._proxy.codegen import forward_signature, render_forward_methods, template_text
from tests.proxy._remote import Affine, VarArgs


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


@pytest.mark.parametrize(
    "module_cls", [Affine, VarArgs, torch.nn.Linear, torch.nn.EmbeddingBag, torch.nn.MultiheadAttention]
)
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


def test_only_the_given_arguments_travel():
    rec, fwd, fwd_async = bind(Affine)
    x = torch.ones(1)
    assert fwd(x) == "result"
    fwd(x, 2.0, shift=x)
    assert fwd_async(x, scale=3.0).wait() == "result"
    fwd_async(x, shift=None)
    assert rec.sent[0] == ("sync", (x,), {})
    assert rec.sent[1] == ("sync", (x, 2.0), {"shift": x})
    assert rec.sent[2] == ("async", (x, 3.0), {})
    assert rec.sent[3] == ("async", (x,), {"shift": None})  # given, even if equal to the default


def _every_kind(a, b=1, c=2, /, d=3, e=4, *rest, g, h=5, **extra):
    pass


EVERY_KIND_CALLS = [
    ((0,), {"g": 1}),
    ((0, 1), {"g": 1}),
    ((0, 1, 2), {"g": 1, "h": 8}),
    ((0,), {"e": 9, "g": 1}),  # b, c, d left out before e: e travels as a keyword
    ((0, 1, 2), {"e": 9, "g": 1}),  # d left out before e
    ((0, 1, 2, 3), {"e": 9, "g": 1}),
    ((0, 1), {"d": 5, "g": 1, "a": 3}),  # a is positional-only: this "a" is for **extra
    ((0, 1, 2, 3, 4, 5, 6), {"g": 7, "h": 8, "z": 9}),
]


@pytest.mark.parametrize("args,kwargs", EVERY_KIND_CALLS, ids=[str(i) for i in range(len(EVERY_KIND_CALLS))])
def test_what_travels_binds_like_the_call_itself(args, kwargs):
    sig = inspect.signature(_every_kind)
    rec = Recorder()
    fwd, fwd_async = render_forward_methods(sig, "every_kind")
    types.MethodType(fwd, rec)(*args, **kwargs)
    types.MethodType(fwd_async, rec)(*args, **kwargs)
    given = sig.bind(*args, **kwargs).arguments  # bind() fills in no defaults
    for _, sent_args, sent_kwargs in rec.sent:
        assert sig.bind(*sent_args, **sent_kwargs).arguments == given


def test_shown_signature_has_the_real_default_objects():
    missing = object()

    def f(x, mask=missing, *, table=torch.zeros(3)):
        pass

    fwd, fwd_async = render_forward_methods(inspect.signature(f), "f")
    for fn in (fwd, fwd_async):
        params = inspect.signature(fn).parameters
        assert params["mask"].default is missing
        assert params["table"].default is inspect.signature(f).parameters["table"].default
    assert str(inspect.signature(fwd)) == "(_rm_self, /, x, mask=" + repr(missing) + ", *, table=tensor([0., 0., 0.]))"


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
    assert "def forward(_rm_self, /, x: _rm_a0, scale: _rm_a1 = _rm_omit, *, shift: _rm_a2 = _rm_omit)" in src
    assert "templates/forward.py.tpl" in template_text("forward.py.tpl")
    # without defaults the body stays one expression (the small-call fast path)
    _, fwd, _ = bind(torch.nn.Linear)
    assert "    return _rm_self._remote_call_sync((input, ), {})\n" in inspect.getsource(fwd)


class AnyKeywords(torch.nn.Module):
    def forward(self, x, **kw):
        return x


def test_a_keyword_named_like_the_proxy_parameter_reaches_var_keyword():
    # A local module takes forward(x, _rm_self=2) into **kw; the generated methods must too
    # (their proxy parameter is positional-only, like ``self`` behind Module.__call__).
    rec, fwd, fwd_async = bind(AnyKeywords)
    fwd(1, _rm_self=2)
    fwd_async(1, _rm_self=3, self=4)
    assert rec.sent == [("sync", (1,), {"_rm_self": 2}), ("async", (1,), {"_rm_self": 3, "self": 4})]


def test_parameter_names_that_would_clash_are_rejected():
    sig = inspect.Signature([inspect.Parameter("_rm_self", inspect.Parameter.POSITIONAL_OR_KEYWORD)])
    with pytest.raises(ValueError, match="_rm_self"):
        render_forward_methods(sig, "Clash")


def test_a_parameter_with_the_reserved_prefix_is_refused_with_its_name():
    def forward(x, _rm_mask=None):
        return x

    with pytest.raises(ValueError, match="_rm_mask"):
        render_forward_methods(inspect.signature(forward), "Net.forward")
