"""Pickle-level proof of identity shipping, no RPC (run by tests/proxy/test_shipping.py):

    python tests/proxy/scripts/shipping_same.py dump OUT          # pickle __main__ objects to OUT
    python tests/proxy/scripts/shipping_same.py load IN BACK      # another process of this script

``load`` prints ``RESULT <json>``: whether what arrived is this process's own objects, and
whether what tests/proxy/scripts/shipping_other.py (a different script) sent back is too.
"""

import collections
import dataclasses
import json
import pickle
import sys
import threading

import torch

from remote_module._proxy.shipping import by_value_reduce

Point = collections.namedtuple("Point", "x y")


@dataclasses.dataclass
class Config:
    scale: float = 2.0


class Net(torch.nn.Module):
    instances = 0

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        Net.instances += 1
        self.cfg = cfg

    def forward(self, x: torch.Tensor) -> Point:
        return Point(x * self.cfg.scale, Net.instances)


_LOCK = threading.Lock()
_SINGLETON: list = []


def shared_net() -> Net:
    with _LOCK:
        if not _SINGLETON:
            _SINGLETON.append(Net(Config()))
        return _SINGLETON[0]


def local_class() -> type:
    class Local:
        tag = "local"

    return Local


class Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        reduced = by_value_reduce(obj)
        return NotImplemented if reduced is None else reduced


def dumps(obj) -> bytes:
    import io

    buf = io.BytesIO()
    Pickler(buf).dump(obj)
    return buf.getvalue()


def sent() -> dict:
    return {
        "Net": Net,
        "Point": Point,
        "point": Point(1, 2),
        "nested": [{"cfg": Config(3.0)}],
        "factory": shared_net,
        "local": local_class(),
    }


if __name__ == "__main__":
    if sys.argv[1] == "dump":
        with open(sys.argv[2], "wb") as f:
            f.write(pickle.dumps({k: dumps(v) for k, v in sent().items()}))
    else:
        with open(sys.argv[2], "rb") as f:
            got = {k: pickle.loads(v) for k, v in pickle.load(f).items()}
        with open(sys.argv[3], "rb") as f:
            back = pickle.load(f)
        print("RESULT " + json.dumps({
            "main": __name__,
            "Net": got["Net"] is Net,
            "Point": got["Point"] is Point,
            "point": type(got["point"]) is Point and got["point"] == (1, 2),
            "nested": type(got["nested"][0]["cfg"]) is Config,
            "factory": got["factory"] is shared_net,
            "local_is_copy": got["local"].tag == "local" and got["local"] is not local_class(),
            "back_out": type(back["out"]) is Point and back["out"].x.tolist() == 3.0,
            "back_cls": back["cls"] is Net,
            "back_cfg": type(back["cfg"]) is Config,
        }))
