"""A different script with same-named objects of different code (run by tests/proxy/test_shipping.py):

    python tests/proxy/scripts/shipping_other.py IN BACK

Loads what tests/proxy/scripts/shipping_same.py pickled: every object must arrive as a copy of the
sender's code, not as this script's own. Runs the copied Net, pickles its output, the copied
class and a copied Config to BACK, and prints ``RESULT <json>``.
"""

import collections
import dataclasses
import io
import json
import pickle
import sys

import torch

from remote_module._proxy.shipping import by_value_reduce

Point = collections.namedtuple("Point", "x y")  # same line as in shipping_same.py, other file


@dataclasses.dataclass
class Config:
    scale: float = 100.0


class Net(torch.nn.Module):
    instances = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -x


def shared_net() -> Net:
    return Net()


class Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        reduced = by_value_reduce(obj)
        return NotImplemented if reduced is None else reduced


if __name__ == "__main__":
    with open(sys.argv[1], "rb") as f:
        raw = pickle.load(f)
    got = {k: pickle.loads(v) for k, v in raw.items() if k != "factory"}
    try:
        pickle.loads(raw["factory"])
        factory_error = ""
    except pickle.UnpicklingError as exc:
        factory_error = str(exc)
    net = got["Net"](got["nested"][0]["cfg"])
    out = net(torch.tensor(1.0))
    buf = io.BytesIO()
    Pickler(buf).dump({"out": out, "cls": got["Net"], "cfg": got["nested"][0]["cfg"]})
    with open(sys.argv[2], "wb") as f:
        f.write(buf.getvalue())
    print("RESULT " + json.dumps({
        "Net_is_copy": got["Net"] is not Net and got["Net"].__qualname__ == "Net",
        "Point_is_copy": got["Point"] is not Point,
        "cfg_is_copy": type(got["nested"][0]["cfg"]) is not Config and got["nested"][0]["cfg"].scale == 3.0,
        "copy_runs_sender_code": type(out) is got["Point"] and out.x.item() == 3.0 and out.y == 1,
        "own_untouched": Net.instances == 0,
        "factory_error": factory_error,
        "local_is_copy": got["local"].tag == "local",
    }))
