"""Device profiles: the rates a step-time prediction divides work by, and the peaks
MFU divides by (shared: `eqxpar.train.Throughput` reads them)."""

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._errors import PlanError


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """What one accelerator and its links can do, for predicting a step's time.

    **Fields:**

    - `name`: a label for tables.
    - `flops_per_s`: dtype name (`"float32"`, `"bfloat16"`) -> dense matmul FLOP/s.
    - `hbm_bytes_per_s`: device memory bandwidth (a copy's bytes read + written / s).
    - `intra_node_bytes_per_s`: bytes per second one device sends to the others
      of its node (one direction).
    - `inter_node_bytes_per_s`: bytes per second one device sends across nodes.
    - `devices_per_node`: devices that share the fast intra-node links.
    - `memory_bytes`: device memory, the default budget of `eqxpar.advise`.
    - `dcn_bytes_per_s`: bytes per second one device sends to other slices over
      the data-centre network (DCN), where the hardware is run as several slices
      (TPU multislice); default None.
    - `devices_per_slice`: devices in one slice (default None: the run is one
      slice). A collective whose group spans more devices than a slice moves
      at `dcn_bytes_per_s`; `eqxpar.advise(..., slices=N)` sets it to the
      device count over `N`.
    - `peak_flops_per_s`: dtype name -> the vendor's *dense* peak matmul FLOP/s, the
      denominator of model FLOPs utilisation (`peak`, `eqxpar.train.Throughput`);
      default None: no published peak, and `peak` answers with the measured
      `flops_per_s` instead. Each peak must be at least the measured rate of its
      dtype (a rate above the peak means one of them is wrong).

    `flops_per_s` is what the advisor predicts step times with; `peak_flops_per_s`
    is only for MFU. The trap in spec sheets: NVIDIA lists tensor-core rates "with
    sparsity" (2:4 structured sparsity, which dense training does not use), twice
    the dense rate. An H100 SXM does 989 TFLOP/s of dense bf16, not the 1,979 its
    sheet shows first (and 1,979 is also its dense fp8 rate); an MFU computed
    against 1,979 reads half what it is. Take the dense figure.

    - `platform`: `"cpu"`, `"gpu"` (the default) or `"tpu"`: the XLA backend the
      step compiles for. On `"tpu"` the advisor predicts the TPU compiler's
      automatic partitioning (`eqxpar.advise`: each layer's weight gradient
      reduce-scattered as the backward pass reaches it, so no gradient is whole
      per device); elsewhere every gradient whole per device until it is reduced,
      as XLA:CPU compiles it.

    Build your own for other hardware; `PROFILES` holds eqxpar's.

    ```python
    mine = eqxpar.DeviceProfile(
        name="my-gpu", flops_per_s={"float32": 100e12, "bfloat16": 400e12},
        hbm_bytes_per_s=2e12, intra_node_bytes_per_s=300e9,
        inter_node_bytes_per_s=25e9, devices_per_node=4, memory_bytes=48 * 2**30,
        peak_flops_per_s={"bfloat16": 500e12},  # dense, from the spec sheet
    )
    ```
    """

    name: str
    flops_per_s: Mapping[str, float]
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    devices_per_node: int
    memory_bytes: int
    peak_flops_per_s: Mapping[str, float] | None = None
    platform: str = "gpu"
    dcn_bytes_per_s: float | None = None
    devices_per_slice: int | None = None

    def __post_init__(self):
        rates = dict(self.flops_per_s)
        if "float32" not in rates or any(not (r > 0) for r in rates.values()):
            raise PlanError(
                f"DeviceProfile(flops_per_s={rates!r}): expected positive FLOP/s per dtype name, "
                "including 'float32', e.g. {'float32': 100e12, 'bfloat16': 400e12}."
            )
        for what in ("hbm_bytes_per_s", "intra_node_bytes_per_s", "inter_node_bytes_per_s"):
            if not getattr(self, what) > 0:
                raise PlanError(f"DeviceProfile({what}={getattr(self, what)!r}): expected a positive rate.")
        if self.devices_per_node < 1 or self.memory_bytes < 1:
            raise PlanError(
                f"DeviceProfile(devices_per_node={self.devices_per_node!r}, memory_bytes="
                f"{self.memory_bytes!r}): expected positive integers."
            )
        if self.platform not in ("cpu", "gpu", "tpu"):
            raise PlanError(
                f"DeviceProfile(platform={self.platform!r}): expected 'cpu', 'gpu' or 'tpu', the XLA "
                "backend the step compiles for."
            )
        if self.dcn_bytes_per_s is not None and not self.dcn_bytes_per_s > 0:
            raise PlanError(
                f"DeviceProfile(dcn_bytes_per_s={self.dcn_bytes_per_s!r}): expected a positive rate."
            )
        if self.devices_per_slice is not None:
            if not isinstance(self.devices_per_slice, int) or self.devices_per_slice < 1:
                raise PlanError(
                    f"DeviceProfile(devices_per_slice={self.devices_per_slice!r}): expected a positive integer."
                )
            if self.dcn_bytes_per_s is None:
                raise PlanError(
                    f"DeviceProfile(name={self.name!r}, devices_per_slice={self.devices_per_slice}) has no "
                    "dcn_bytes_per_s: the rate between slices is what a slice size is for. Give both."
                )
        # A plain dict, frozen by convention: the profile is a value.
        object.__setattr__(self, "flops_per_s", rates)
        if self.peak_flops_per_s is not None:
            object.__setattr__(self, "peak_flops_per_s", self._checked_peaks(rates))

    def _checked_peaks(self, rates: dict[str, float]) -> dict[str, float]:
        peaks = dict(self.peak_flops_per_s)
        if not peaks or any(not isinstance(p, int | float) or not (p > 0) for p in peaks.values()):
            raise PlanError(
                f"DeviceProfile(peak_flops_per_s={peaks!r}): expected positive dense peak FLOP/s per "
                "dtype name, e.g. {'bfloat16': 989.4e12}, or None where no peak is published."
            )
        for dtype, peak in peaks.items():
            if dtype in rates and rates[dtype] > peak:
                raise PlanError(
                    f"DeviceProfile(name={self.name!r}): the measured {dtype} rate "
                    f"flops_per_s[{dtype!r}]={rates[dtype]:.4g} is above its peak "
                    f"peak_flops_per_s[{dtype!r}]={peak:.4g}. A peak is the most the hardware can "
                    "do: check both figures (is the peak the rate of the precision the matmuls "
                    "actually run in, e.g. TF32 for float32 on tensor cores?)."
                )
        return peaks

    def flops(self, dtype: Any) -> float:
        """Matmul FLOP/s for arrays of `dtype` (float32's rate for dtypes not listed)."""
        name = getattr(dtype, "name", str(dtype))
        return self.flops_per_s.get(name, self.flops_per_s["float32"])

    def peak(self, dtype: Any) -> float:
        """The dense peak matmul FLOP/s for arrays of `dtype`: the denominator of MFU.

        **Arguments:**

        - `dtype`: a dtype (`jnp.bfloat16`) or its name (`"bfloat16"`; `"tfloat32"`
          where a profile lists it).

        **Returns:** `peak_flops_per_s[name]`; for a profile with no peaks
        (`peak_flops_per_s=None`, as `"cpu"`), the measured `flops(dtype)`, so an
        MFU reads against what the hardware was measured to reach.

        Raises `PlanError` for a dtype the profile's peaks do not list (float32's
        peak is not bfloat16's, so none is guessed).

        ```python
        eqxpar.DEVICE_PROFILES["h100"].peak("bfloat16")  # 989.4e12 (dense; 1979e12 is sparse)
        ```
        """
        name = _dtype_name(dtype)
        if self.peak_flops_per_s is None:
            return self.flops(name)
        if name not in self.peak_flops_per_s:
            raise PlanError(
                f"DeviceProfile(name={self.name!r}).peak({name!r}): no peak for {name!r}; the profile "
                f"lists {sorted(self.peak_flops_per_s)}. Pass the dtype the step's matmuls run in, "
                "or build a DeviceProfile whose peak_flops_per_s has it."
            )
        return self.peak_flops_per_s[name]

    def link(self, group: int, stride: int) -> float:
        """Bytes per second per device of a collective over `group` devices whose
        neighbours are `stride` devices apart in the mesh's device order: within a
        node when the whole group fits inside one; across slices (the data-centre
        network, `dcn_bytes_per_s`) when it spans more devices than a slice."""
        span = group * stride
        if self.devices_per_slice is not None and span > self.devices_per_slice:
            assert self.dcn_bytes_per_s is not None  # __post_init__
            return self.dcn_bytes_per_s
        return self.intra_node_bytes_per_s if span <= self.devices_per_node else self.inter_node_bytes_per_s


#: eqxpar's profiles. "h100": an 8-GPU H100 SXM node. Matmul and copy rates are
#: measured on one H100 by `benchmarks.one_device` (benchmarks/results/
#: one_device_gpu.json: 682 TFLOP/s bf16, 358 f32, 2.54 TB/s copy); the links
#: cannot be measured here and come from NVIDIA's public specifications: NVLink 4
#: at 900 GB/s per GPU both directions (450 GB/s each way), and one 400 Gb/s
#: ConnectX-7 InfiniBand NIC per GPU (50 GB/s) across nodes; 80 GB HBM3.
#: "tpu_v5p": Google's public TPU v5p figures (459 TFLOP/s bf16, 2.765 TB/s HBM,
#: 95 GB HBM; ICI 4,800 Gb/s per chip, taken as 600 GB/s within a 4x4x4 cube of
#: 64 chips, float32 matmuls at a quarter of bf16); nothing measured here. Its
#: data-centre network (DCN), between slices: 50 Gb/s per chip, 6.25 GB/s, the
#: "Data center network (DCN) bandwidth per chip" of Cloud TPU's v5p page
#: (https://cloud.google.com/tpu/docs/v5p), taken as each chip's rate in one
#: direction with all chips of a slice sending at once (a ring over slices pairs
#: each chip with its peer in the next slice), no congestion; one slice unless
#: told (`devices_per_slice`, or `advise(..., slices=N)`). ICI at 600 GB/s is 96x
#: that.
#: "cpu": this repository's simulated devices, measured on the 2-core CPU machine
#: (benchmarks/results/one_device_cpu.json: 0.29 TFLOP/s f32, 0.26 bf16, 8.3 GB/s
#: copy); the 8 devices share the host's memory, so a collective moves at the
#: copy rate; 8 GiB of memory per device.
#:
#: Peaks (`peak_flops_per_s`, for MFU only), dense, from the vendors' sheets.
#: H100 SXM: 989.4 TFLOP/s bf16 and fp16 (the sheet's 1,979 is with 2:4
#: sparsity), 1,978.9 fp8, 494.7 TF32. float32 takes TF32's peak: JAX's default
#: matmul precision runs float32 matmuls on the tensor cores as TF32 (the measured
#: 358 TFLOP/s is over five times the 66.9 TFLOP/s of the non-tensor float32 units,
#: which only `precision="highest"` uses). TPU v5p: 459 TFLOP/s bf16; no float32
#: peak is published, so none is listed. "cpu": no published peak; `peak` gives
#: the measured rates.
PROFILES: dict[str, DeviceProfile] = {
    "h100": DeviceProfile(
        name="h100",
        flops_per_s={"float32": 357.9e12, "bfloat16": 681.8e12, "float16": 681.8e12},
        hbm_bytes_per_s=2.540e12,
        intra_node_bytes_per_s=450e9,
        inter_node_bytes_per_s=50e9,
        devices_per_node=8,
        memory_bytes=80 * 10**9,
        peak_flops_per_s={
            "bfloat16": 989.4e12,
            "float16": 989.4e12,
            "float8_e4m3fn": 1978.9e12,
            "float8_e5m2": 1978.9e12,
            "tfloat32": 494.7e12,
            "float32": 494.7e12,
        },
    ),
    "tpu_v5p": DeviceProfile(
        name="tpu_v5p",
        flops_per_s={"float32": 459e12 / 4, "bfloat16": 459e12},
        hbm_bytes_per_s=2.765e12,
        intra_node_bytes_per_s=600e9,
        inter_node_bytes_per_s=600e9 / 4,
        devices_per_node=64,
        memory_bytes=95 * 10**9,
        peak_flops_per_s={"bfloat16": 459e12},
        platform="tpu",
        dcn_bytes_per_s=50e9 / 8,
    ),
    "cpu": DeviceProfile(
        name="cpu",
        flops_per_s={"float32": 0.2949e12, "bfloat16": 0.2556e12},
        hbm_bytes_per_s=8.347e9,
        intra_node_bytes_per_s=8.347e9,
        inter_node_bytes_per_s=8.347e9,
        devices_per_node=8,
        memory_bytes=8 * 2**30,
        platform="cpu",
    ),
}


def _dtype_name(dtype: Any) -> str:
    """ "bfloat16" for `jnp.bfloat16`, `np.dtype("bfloat16")` or the string itself."""
    if isinstance(dtype, str):
        return dtype
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


def as_profile(device: Any) -> DeviceProfile:
    """`device` (a `DeviceProfile` or a name in `PROFILES`) as a profile."""
    if isinstance(device, DeviceProfile):
        return device
    if isinstance(device, str) and device in PROFILES:
        return PROFILES[device]
    raise PlanError(
        f"advise(device={device!r}): expected a DeviceProfile or one of {sorted(PROFILES)}. "
        "Build an eqxpar.DeviceProfile for other hardware."
    )
