#!/usr/bin/env python3
"""Continue training the testbed model from a checkpoint (a second round of train.py).

train.py always starts from random weights. This runs train.py's own main() unchanged, with two
substitutions made before it starts: the model is built from --init CKPT's weights instead of random
ones, and the data stream starts from another seed (--data-base) so the second round sees new
problems. Every train.py flag is passed through (--lr, --train-seconds, --deadline, --out, ...).

  python3 train_continue.py --init round1/ckpt.pt --data-base 11 --out OUT --lr 1.2e-3 \
      --train-seconds 525 --deadline 578 --evals 1 --workers 12
"""
import os
import sys

TESTBED = os.environ.get("TESTBED_DIR", os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTBED)


def pop_flag(name, default=None):
    if name in sys.argv:
        i = sys.argv.index(name)
        val = sys.argv[i + 1]
        del sys.argv[i:i + 2]
        return val
    return default


init = pop_flag("--init")
data_base = int(pop_flag("--data-base", "11"))
if init is None:
    sys.exit("train_continue.py: --init CKPT is required (a ckpt.pt written by train.py)")

import torch  # noqa: E402
import model as M  # noqa: E402
import train as T  # noqa: E402

_Base = M.Transformer


class WarmStarted(_Base):
    def __init__(self, cfg):
        super().__init__(cfg)
        ck = torch.load(init, map_location="cpu", weights_only=False)
        self.load_state_dict(ck["model"], strict=True)
        print("warm start from %s (%s steps, %s tokens)" % (init, ck.get("steps"), ck.get("tokens")),
              flush=True)


M.Transformer = WarmStarted

_Feeder = T.Feeder


class NewData(_Feeder):
    def __init__(self, pool, base, *a, **k):
        super().__init__(pool, data_base, *a, **k)


T.Feeder = NewData
T.main()
