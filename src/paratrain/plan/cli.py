"""The ``paratrain plan`` command line: flags, model loading and the printed report.

The library is :mod:`paratrain.plan`; this module only turns arguments into its calls.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from paratrain.config import PRECISIONS
from paratrain.plan.calibration import calibrate, default_model
from paratrain.plan.device import device_memory, device_name, select_device
from paratrain.plan.large_model_rows import cli_shape, plan_context_experts
from paratrain.plan.layouts import parse_layout, resolve_layout
from paratrain.plan.links import PRESETS, link_preset, resolve_links
from paratrain.plan.model import STRATEGIES
from paratrain.plan.report import PlanReport
from paratrain.plan.scaling import format_scaling, parse_node_counts, plan_scaling, scaling_dict
from paratrain.plan.semi_sync import exposed_share, link_is_slow, plan_semi_sync
from paratrain.plan.types import Hardware, ModelProfile
from paratrain.units import (
    format_bytes,
    format_seconds,
    parse_bandwidth,
    parse_duration,
    parse_size,
)

__all__ = ["main"]

# --- command line -------------------------------------------------------------------


class _UsageError(Exception):
    """Bad command-line input; the message starts with the flag at fault."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line instead of usage + message
        raise _UsageError(message)


def _arg_type(parse: Callable[[str], Any], check: Callable[[Any], bool] = lambda v: True,
              requirement: str = "") -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if not check(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text!r}")
        return value

    return convert


_POS_INT = _arg_type(int, lambda v: v >= 1, "a positive integer")


def _build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="paratrain plan", description="Predict step time, throughput and "
                "per-device memory of each parallel strategy (analytic model, runs nothing).")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="MODULE:CALLABLE",
                     help="import and calibrate this nn.Module factory (default: a small ConvNet)")
    src.add_argument("--num-parameters", type=_POS_INT, help="skip calibration: parameter count")
    p.add_argument("--input-shape", default="1,28,28", help="per-sample input shape (default 1,28,28)")
    p.add_argument("--time-per-sample", type=_arg_type(parse_duration, lambda v: v > 0, "positive"),
                   help="forward+backward time per sample, e.g. 2ms (default: calibrated, or "
                   "6 FLOPs per parameter at 1 TFLOP/s with --num-parameters)")
    p.add_argument("--activation-bytes", type=_arg_type(parse_size),
                   help="activation bytes per sample (default: calibrated, or 0)")
    p.add_argument("--layers", type=_POS_INT, help="number of layers (default: calibrated, or 1)")
    p.add_argument("--param-bytes", type=_POS_INT, help="bytes per parameter and gradient")
    p.add_argument("--optimizer-bytes",
                   type=_arg_type(float, lambda v: 0 <= v < float("inf"), "non-negative"),
                   default=8.0, help="optimizer bytes per parameter (default 8: Adam)")
    p.add_argument("--checkpointing", action="store_true", help="assume activation checkpointing")
    p.add_argument("--device", help="calibrate on cpu, cuda or cuda:N (default: cuda when "
                   "visible, else cpu)")
    p.add_argument("--precision", choices=PRECISIONS, default="32",
                   help="calibrate in this precision (autocast for the mixed ones; default 32)")
    p.add_argument("--devices-per-node", type=_POS_INT, default=4)
    p.add_argument("--nodes", type=_arg_type(parse_node_counts), default=(1,),
                   help="node count, or a list such as 1,2,4,8 for a scaling table (default 1)")
    preset = _arg_type(lambda t: link_preset(t).name)
    p.add_argument("--intra-node", type=preset, metavar="LINK",
                   help=f"link between a node's devices: {', '.join(PRESETS)} (default: "
                   "guessed from the GPU, else ethernet-10g)")
    p.add_argument("--inter-node", type=preset, metavar="LINK",
                   help="network between nodes, e.g. infiniband-ndr (default: see docs/plan.md)")
    bw = _arg_type(parse_bandwidth)
    lat = _arg_type(parse_duration, lambda v: v >= 0, "non-negative")
    p.add_argument("--bandwidth", type=bw,
                   help="intra-node bandwidth, e.g. 10Gbit, 25GB (overrides --intra-node)")
    p.add_argument("--inter-node-bandwidth", type=bw, help="overrides --inter-node")
    p.add_argument("--latency", type=lat, help="intra-node latency, e.g. 5us (overrides --intra-node)")
    p.add_argument("--inter-node-latency", type=lat, help="overrides --inter-node")
    p.add_argument("--batch-size", type=_POS_INT, default=32, help="per device (default 32)")
    p.add_argument("--device-memory", type=_arg_type(parse_size, lambda v: v > 0, "positive"),
                   help="e.g. 16GB (default: not checked)")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help=f"comma-separated subset of {','.join(STRATEGIES)}")
    p.add_argument("--num-servers", type=_POS_INT, default=1, help="parameter servers for ps")
    p.add_argument("--microbatches", type=_POS_INT, help="pipeline micro-batches (default 4 x stages)")
    p.add_argument("--layout", type=_arg_type(parse_layout), metavar="pp=P,dp_shard=S,...",
                   help="cost hybrid in this layout (pp, dp_replicate, dp_shard, tp; the "
                   "others inferred as hybrid infers them; default: its best layout)")
    p.add_argument("--overlap", type=_arg_type(float, lambda v: 0 <= v <= 1, "in [0, 1]"),
                   default=1.0, help="share of backward that hides gradient communication")
    p.add_argument("--sequence", type=_POS_INT, metavar="N",
                   help="tokens per sample: also cost context parallel (cp=2, cp=4) and "
                   "print activations per rank against sequence length")
    p.add_argument("--width", type=_POS_INT, metavar="D", help="model width for --sequence "
                   "(default: estimated from the parameter count and --layers)")
    p.add_argument("--experts", type=_POS_INT, metavar="E", help="experts per MoE layer "
                   "(with --sequence): also cost expert parallel (ep=2, ep=4)")
    p.add_argument("--top-k", type=_POS_INT, metavar="K", help="experts per token (default 1)")
    p.add_argument("--semi-sync", type=_POS_INT, metavar="H", help="cost LocalSGD and DiLoCo "
                   "syncing every H steps over the nodes (default: H = 10, 50, 100 when the "
                   "inter-node link is slow for the model)")
    p.add_argument("--repeats", type=_POS_INT, default=3, help="timed calibration passes")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON ('-': stdout only)")
    return p


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _load_model(spec: str) -> Any:
    from torch import nn

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise _UsageError(f"--model: expected MODULE:CALLABLE, got {spec!r}")
    added = os.getcwd() not in sys.path
    if added:  # let `--model mymodels:make` find files in the working directory
        sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(module_name), attr)
        model = factory() if not isinstance(factory, nn.Module) else factory
    except Exception as exc:  # any import/construct failure is the flag's fault
        raise _UsageError(f"--model: cannot load {spec!r}: {_one_line(exc)}") from None
    finally:
        if added:
            sys.path.remove(os.getcwd())
    if not isinstance(model, nn.Module):
        raise _UsageError(f"--model: {spec!r} returned {type(model).__name__}, not an nn.Module")
    return model


def _device(args: argparse.Namespace) -> Any:
    try:
        return select_device(args.device)
    except ValueError as exc:
        raise _UsageError(f"--{exc}") from None


def _profile(args: argparse.Namespace, device: Any) -> ModelProfile:
    if args.num_parameters is not None:
        n = args.num_parameters
        profile = ModelProfile(
            num_parameters=n, activation_bytes_per_sample=args.activation_bytes or 0,
            compute_time_per_sample=args.time_per_sample or 6 * n / 1e12,
            num_layers=args.layers or 1)
    else:
        import torch

        try:
            shape = tuple(int(x) for x in args.input_shape.split(","))
            if not shape or min(shape) < 1:
                raise ValueError
        except ValueError:
            raise _UsageError(f"--input-shape: expected positive integers such as 1,28,28, "
                              f"got {args.input_shape!r}") from None
        model = default_model() if args.model is None else _load_model(args.model)
        example = torch.randn(args.batch_size, *shape)
        try:
            profile = calibrate(model, example, repeats=args.repeats, device=device,
                                precision=args.precision, optimizer=_optimizer(args))
        except Exception as exc:  # shape mismatch and the like
            flag = "--input-shape" if args.model is None else "--model"
            raise _UsageError(f"{flag}: calibration on input {tuple(example.shape)} failed: "
                              f"{_one_line(exc)}") from None
        overrides = {"compute_time_per_sample": args.time_per_sample,
                     "activation_bytes_per_sample": args.activation_bytes,
                     "num_layers": args.layers}
        profile = replace(profile, **{k: v for k, v in overrides.items() if v is not None})
    extra: dict[str, Any] = {"optimizer_bytes_per_param": args.optimizer_bytes,
                             "activation_checkpointing": args.checkpointing}
    if args.param_bytes is not None:
        extra.update(param_bytes=args.param_bytes, grad_bytes=args.param_bytes)
    return replace(profile, **extra)


def _optimizer(args: argparse.Namespace) -> str | None:
    # The optimizer whose state --optimizer-bytes describes: Adam (8), momentum SGD (4).
    return {8.0: "adam", 4.0: "sgd"}.get(args.optimizer_bytes)


def _describe(report: PlanReport, calibration: str, links: Any, nodes: str) -> str:
    pr, hw = report.profile, report.hardware
    mem = "not checked" if hw.device_memory_bytes is None else format_bytes(hw.device_memory_bytes)
    opt = (f", optimizer step {format_seconds(pr.optimizer_step_time)}"
           if pr.optimizer_step_time else "")
    ckpt = ", checkpointing" if pr.activation_checkpointing else ""
    return (f"model:    {pr.num_parameters:,} parameters ({format_bytes(pr.param_size)}), "
            f"{pr.num_layers} layers, {format_seconds(pr.compute_time_per_sample)}/sample "
            f"fwd+bwd{opt}, {format_bytes(pr.activation_bytes_per_sample)} activations/sample"
            f"{ckpt}\n"
            f"measured: {calibration}\n"
            f"hardware: {nodes} node(s) x {hw.num_devices_per_node} device(s), device "
            f"memory {mem}\n"
            f"links:    intra-node {format_bytes(hw.intra_node_bandwidth)}/s + "
            f"{format_seconds(hw.intra_node_latency)} ({links.intra_label}), inter-node "
            f"{format_bytes(hw.inter_node_bandwidth)}/s + {format_seconds(hw.inter_node_latency)} "
            f"({links.inter_label}); peak figures\n"
            f"batch:    {report.batch_size_per_device} per device")


def _run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad or not strategies:
        raise _UsageError(f"--strategies: unknown {', '.join(bad) or '(empty)'}; "
                          f"choose from {','.join(STRATEGIES)}")
    for flag in ("width", "experts", "top_k"):
        if getattr(args, flag) is not None and args.sequence is None:
            raise _UsageError(f"--{flag.replace('_', '-')}: needs --sequence (tokens per sample)")
    if args.top_k is not None and args.experts is None:
        raise _UsageError("--top-k: needs --experts")
    device = _device(args)
    on_gpu = device.type == "cuda"
    try:
        links = resolve_links(
            intra_node=args.intra_node, inter_node=args.inter_node, bandwidth=args.bandwidth,
            latency=args.latency, inter_node_bandwidth=args.inter_node_bandwidth,
            inter_node_latency=args.inter_node_latency,
            gpu_name=device_name(device) if on_gpu else None)
    except ValueError as exc:
        raise _UsageError(f"--{exc}") from None
    if args.layout is not None and "hybrid" not in strategies:
        raise _UsageError("--layout: it costs strategy hybrid, which --strategies leaves out")
    memory = args.device_memory if args.device_memory is not None else device_memory(device)
    hardware = Hardware(
        intra_node_bandwidth=links.intra_bandwidth, intra_node_latency=links.intra_latency,
        inter_node_bandwidth=links.inter_bandwidth, inter_node_latency=links.inter_latency,
        device_memory_bytes=memory, num_devices_per_node=args.devices_per_node,
        num_nodes=args.nodes[0])
    for nodes in args.nodes if args.layout is not None else ():
        try:
            resolve_layout(args.layout, replace(hardware, num_nodes=nodes))
        except ValueError as exc:
            raise _UsageError(f"--layout: {exc} ({nodes} node(s) x {args.devices_per_node} "
                              "devices)") from None
    calibration = ("not calibrated (--num-parameters)" if args.num_parameters is not None else
                   f"{device_name(device) if on_gpu else 'this CPU'} ({device}), precision "
                   f"{args.precision}")
    profile = _profile(args, device)
    cx = None if args.sequence is None else _context_experts(args, profile, hardware)
    try:
        reports = plan_scaling(profile, hardware, args.nodes,
                               batch_size_per_device=args.batch_size, strategies=strategies,
                               num_servers=args.num_servers, num_microbatches=args.microbatches,
                               overlap=args.overlap, layout=args.layout)
    except ValueError as exc:
        flag = "--microbatches" if "num_microbatches" in str(exc) else "input"
        raise _UsageError(f"{flag}: {exc}") from None
    head = _describe(reports[0], calibration, links, ",".join(map(str, args.nodes)))
    if len(reports) == 1:
        report = reports[0]
        data, text = report.to_dict(), (f"{head}\n\n{report.format_table()}\n\nrecommendation:"
                                        f" {report.recommendation}\nreason: {report.reason}")
    else:
        data, text = scaling_dict(reports), f"{head}\n\n{format_scaling(reports)}"
    if cx is not None:
        data["context_experts"] = cx.to_dict()
        text = f"{text}\n\n{cx.format()}"
    semi = _semi_sync(args, reports[0])
    if semi is not None:
        data["semi_sync"] = semi.to_dict()
        text = f"{text}\n\n{semi.format()}"
    return data, text


def _semi_sync(args: argparse.Namespace, report: PlanReport) -> Any:
    """Semi-synchronous rows on the first --nodes count: those of --semi-sync H, else
    H = 10, 50, 100 when the inter-node link is slow for the model; None otherwise."""
    nodes = report.hardware.num_nodes
    if args.semi_sync is None:
        if not link_is_slow(report):
            return None
        return plan_semi_sync(report, why=f"shown because synchronous HSDP over the nodes "
                              f"waits on communication {exposed_share(report):.0%} of its step")
    if nodes < 2:
        raise _UsageError(f"--semi-sync: needs 2+ nodes (one replica group per node); the "
                          f"first --nodes count is {nodes}")
    return plan_semi_sync(report, every=(args.semi_sync,), why=f"--semi-sync {args.semi_sync}")


def _context_experts(args: argparse.Namespace, profile: ModelProfile, hardware: Hardware) -> Any:
    """cp (and ep with --experts) rows on the first --nodes count."""
    try:
        shape = cli_shape(profile, sequence=args.sequence, width=args.width,
                          experts=args.experts or 0, top_k=args.top_k or 1, layers=args.layers)
        return plan_context_experts(profile, hardware, shape, batch=args.batch_size)
    except ValueError as exc:
        text = str(exc)
        raise _UsageError(text if text.startswith("--") else f"--sequence: {text}") from None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``paratrain plan``; returns the exit code (2 for bad input)."""
    try:
        args = _build_parser().parse_args(argv)
        data, text = _run(args)
        payload = json.dumps(data, indent=2)
        if args.json == "-":
            print(payload)
            return 0
        if args.json:
            try:
                with open(args.json, "w", encoding="utf-8") as fh:
                    fh.write(payload + "\n")
            except OSError as exc:
                raise _UsageError(f"--json: cannot write {args.json!r}: {exc.strerror}") from None
    except _UsageError as exc:
        print(f"paratrain plan: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help / --version
        return exc.code if isinstance(exc.code, int) else 0
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
