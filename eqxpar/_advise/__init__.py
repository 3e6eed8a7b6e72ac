"""The plan advisor (`eqxpar.advise`): which mesh and plan to run a model on.

`advise(model, loss_fn, optimizer, batch, devices=, memory_per_device=, device=)`
enumerates the plans eqxpar runs for a device count, predicts each one's memory,
wire bytes and step time from shapes alone (`_predict`, from the loss's traced
residuals and FLOPs, `_analysis`, and `eqxpar.inspect.minimum_comm` plus the
overheads of eqxpar's implementations), drops those over the budget and ranks
the rest. Inside: `_profile` (device profiles), `_enumerate` (the families),
`_advice` (`advise`, `Advice`, `Candidate`).
"""

from ._advice import Advice as Advice
from ._advice import Candidate as Candidate
from ._advice import Comparison as Comparison
from ._advice import advise as advise
from ._enumerate import Layout as Layout
from ._predict import Prediction as Prediction
from ._predict import placeholder_mesh as placeholder_mesh
from ._profile import PROFILES as PROFILES
from ._profile import DeviceProfile as DeviceProfile
