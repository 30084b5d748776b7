"""The fake ``pynvml`` now lives in the package, as ``soakd.sim.fake_pynvml`` (``soakd demo`` drives
it from the simulated GPU). This name is an alias of that very module — not a copy — so
``fake_pynvml.reset()``, ``fake_pynvml.scenario`` and monkeypatching behave exactly as before."""

import sys

from soakd.sim import fake_pynvml as _fake_pynvml

sys.modules[__name__] = _fake_pynvml
