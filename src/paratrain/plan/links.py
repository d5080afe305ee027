"""Interconnect presets for ``paratrain plan``: named links with bandwidth and latency.

Bandwidths are vendor **peak** figures for one direction of one device's (or one
port's) link, in bytes/s; the model applies no efficiency factor, so measured bus
bandwidth (e.g. from nccl-tests) can be passed with ``--bandwidth`` instead. Latency is
the alpha of each collective step: NCCL's own per-step estimate for NVLink, PCIe and
network transports (``src/graph/tuning.cc``, ring/Simple), and the historical 50 us for
TCP Ethernet. Sources, per preset, are tabulated in ``docs/plan.md``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class LinkPreset:
    """One interconnect: peak unidirectional bandwidth (bytes/s) and per-step latency (s)."""

    name: str
    bandwidth: float
    latency: float
    intra_node_only: bool
    """True for links between devices of one node (NVLink, PCIe)."""
    source: str
    """Where the bandwidth figure comes from (a vendor or standards document)."""
    latency_source: str

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"bandwidth must be positive, got {self.bandwidth!r}")
        if not self.latency >= 0:
            raise ValueError(f"latency must be non-negative, got {self.latency!r}")


_NCCL_LAT = "NCCL src/graph/tuning.cc hwLat, ring/Simple"
_TCP_LAT = "paratrain's 50 us default for TCP stacks (IEEE 802.3 specifies no latency)"

#: Every preset by name. Gb/s links are divided by 8 (bytes); PCIe uses its 128b/130b coding.
PRESETS: dict[str, LinkPreset] = {p.name: p for p in (
    LinkPreset(name="nvlink4", bandwidth=450e9, latency=3.4e-6, intra_node_only=True,
               source="NVIDIA H100 Tensor Core GPU datasheet: NVLink 900 GB/s per GPU "
               "(bidirectional)", latency_source=f"{_NCCL_LAT}, NVLink"),
    LinkPreset(name="nvlink3", bandwidth=300e9, latency=3.4e-6, intra_node_only=True,
               source="NVIDIA A100 Tensor Core GPU datasheet: NVLink 600 GB/s per GPU "
               "(bidirectional)", latency_source=f"{_NCCL_LAT}, NVLink"),
    LinkPreset(name="pcie4", bandwidth=16e9 * 16 * 128 / 130 / 8, latency=5.7e-6,
               intra_node_only=True, source="PCI-SIG PCI Express Base Specification 4.0: "
               "16 GT/s per lane, x16, 128b/130b", latency_source=f"{_NCCL_LAT}, PCI"),
    LinkPreset(name="pcie5", bandwidth=32e9 * 16 * 128 / 130 / 8, latency=5.7e-6,
               intra_node_only=True, source="PCI-SIG PCI Express Base Specification 5.0: "
               "32 GT/s per lane, x16, 128b/130b", latency_source=f"{_NCCL_LAT}, PCI"),
    LinkPreset(name="infiniband-hdr", bandwidth=200e9 / 8, latency=14e-6, intra_node_only=False,
               source="InfiniBand Trade Association roadmap (HDR 200 Gb/s per 4x port); "
               "NVIDIA ConnectX-6 VPI datasheet", latency_source=f"{_NCCL_LAT}, NET"),
    LinkPreset(name="infiniband-ndr", bandwidth=400e9 / 8, latency=14e-6, intra_node_only=False,
               source="InfiniBand Trade Association roadmap (NDR 400 Gb/s per 4x port); "
               "NVIDIA ConnectX-7 datasheet", latency_source=f"{_NCCL_LAT}, NET"),
    LinkPreset(name="roce-100g", bandwidth=100e9 / 8, latency=14e-6, intra_node_only=False,
               source="IEEE 802.3ba (100 GbE); NVIDIA ConnectX-6 Dx datasheet (RoCE)",
               latency_source=f"{_NCCL_LAT}, NET"),
    LinkPreset(name="roce-200g", bandwidth=200e9 / 8, latency=14e-6, intra_node_only=False,
               source="IEEE 802.3bs (200 GbE); NVIDIA ConnectX-6 Dx datasheet (RoCE)",
               latency_source=f"{_NCCL_LAT}, NET"),
    LinkPreset(name="roce-400g", bandwidth=400e9 / 8, latency=14e-6, intra_node_only=False,
               source="IEEE 802.3bs (400 GbE); NVIDIA ConnectX-7 datasheet (RoCE)",
               latency_source=f"{_NCCL_LAT}, NET"),
    LinkPreset(name="ethernet-1g", bandwidth=1e9 / 8, latency=50e-6, intra_node_only=False,
               source="IEEE 802.3ab (1000BASE-T, 1 GbE)", latency_source=_TCP_LAT),
    LinkPreset(name="ethernet-10g", bandwidth=10e9 / 8, latency=50e-6, intra_node_only=False,
               source="IEEE 802.3ae (10 GbE)", latency_source=_TCP_LAT),
    LinkPreset(name="ethernet-25g", bandwidth=25e9 / 8, latency=50e-6, intra_node_only=False,
               source="IEEE 802.3by (25 GbE)", latency_source=_TCP_LAT),
    LinkPreset(name="ethernet-100g", bandwidth=100e9 / 8, latency=50e-6, intra_node_only=False,
               source="IEEE 802.3ba (100 GbE)", latency_source=_TCP_LAT),
)}
#: Short names accepted as well.
ALIASES: dict[str, str] = {"nvlink": "nvlink4", "pcie": "pcie4", "infiniband": "infiniband-ndr",
                           "ib-hdr": "infiniband-hdr", "ib-ndr": "infiniband-ndr",
                           "ethernet": "ethernet-10g"}
#: Used when nothing names the link: 10 Gbit/s and 50 us, as before presets existed.
DEFAULT_LINK = "ethernet-10g"


def link_preset(name: str) -> LinkPreset:
    """The preset called ``name`` (case-insensitive, aliases allowed); ValueError listing them."""
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in PRESETS:
        raise ValueError(f"unknown interconnect {name!r}; choose from {', '.join(PRESETS)}")
    return PRESETS[key]


def guess_intra_node(gpu_name: str) -> str:
    """The intra-node preset a GPU model usually comes with, from its CUDA device name.

    SXM boards of H100/H200 (and GH200) use NVLink 4 and A100 SXM NVLink 3; "PCIe" boards and
    every other GPU (H800/A800 have slower NVLink) are assumed to talk over PCIe 4 (the safe, slower choice).
    """
    name = gpu_name.upper()
    if "PCIE" not in name and any(k in name for k in ("H100", "H200")):
        return "nvlink4"
    if "PCIE" not in name and "A100" in name:
        return "nvlink3"
    return "pcie4"


@dataclass(frozen=True, kw_only=True)
class Links:
    """Resolved intra- and inter-node links and how each was chosen (shown to the user)."""

    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    intra_label: str
    inter_label: str


def resolve_links(*, intra_node: str | None, inter_node: str | None, bandwidth: float | None,
                  latency: float | None, inter_node_bandwidth: float | None,
                  inter_node_latency: float | None, gpu_name: str | None) -> Links:
    """Combine presets and explicit figures; explicit bandwidth/latency always win.

    Intra-node: ``intra_node`` preset, else a guess from ``gpu_name`` (when calibrating on
    a GPU), else :data:`DEFAULT_LINK`. Inter-node: ``inter_node`` preset, else the explicit
    intra-node figures (as before presets existed), else the intra-node preset when it
    can span nodes, else :data:`DEFAULT_LINK`. A preset that is intra-node only (NVLink,
    PCIe) named for ``inter_node`` is a ValueError naming ``inter-node``.
    """
    if intra_node is not None:
        intra, how = link_preset(intra_node), ""
    elif gpu_name is not None:
        intra = PRESETS[guess_intra_node(gpu_name)]
        how = f", guessed from {gpu_name!r}; set --intra-node"
    else:
        intra, how = PRESETS[DEFAULT_LINK], ", default"
    intra_label = f"{intra.name}{how}" if bandwidth is None and latency is None else "given"
    ib = intra.bandwidth if bandwidth is None else bandwidth
    il = intra.latency if latency is None else latency
    if inter_node is not None:
        inter = link_preset(inter_node)
        if inter.intra_node_only:
            raise ValueError(f"inter-node: {inter.name} links devices inside one node; choose "
                             f"an inter-node network such as infiniband-ndr or ethernet-25g")
        eb, el, inter_label = inter.bandwidth, inter.latency, inter.name
    elif bandwidth is not None or latency is not None:
        eb, el, inter_label = ib, il, "same as intra-node"
    elif not intra.intra_node_only:
        eb, el, inter_label = intra.bandwidth, intra.latency, intra.name
    else:
        default = PRESETS[DEFAULT_LINK]
        eb, el, inter_label = default.bandwidth, default.latency, f"{DEFAULT_LINK}, default"
    if inter_node_bandwidth is not None or inter_node_latency is not None:
        inter_label = "given"
    return Links(intra_bandwidth=ib, intra_latency=il, inter_label=inter_label,
                 inter_bandwidth=eb if inter_node_bandwidth is None else inter_node_bandwidth,
                 inter_latency=el if inter_node_latency is None else inter_node_latency,
                 intra_label=intra_label)
