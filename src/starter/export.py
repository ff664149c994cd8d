"""`python export.py ckpt_path=... format=onnx|torch_export`: a trained model as one file that runs without this
starter, taking decoded images (uint8, N x C x H x W, any N) with the normalisation inside. Kept only if its logits on a
batch of another size differ from the model's by at most `tolerance`."""

import importlib.util
from pathlib import Path

from omegaconf import DictConfig
from torch import nn

from starter.config_schema import check_schema
from starter.errors import UserError, first_line
from starter.launch.environment import launch_plan
from starter.loggers.report import shown
from starter.predict import settle_weights
from starter.topology import Plan, lay_out

FORMATS = {"onnx": "model.onnx", "torch_export": "model.pt2"}
ONNX_PACKAGES = ("onnx", "onnxscript", "onnxruntime")
ONNX_INSIDE_LIMIT = 2**31 - 2**26  # bytes of weights kept inside model.onnx: 2 GiB less room for the graph


def prepare(cfg: DictConfig) -> Plan:
    check_schema(cfg)
    if cfg.format not in FORMATS:
        raise UserError(f"format={cfg.format}: choose one of {', '.join(FORMATS)}")
    if cfg.format == "onnx" and (missing := [p for p in ONNX_PACKAGES if importlib.util.find_spec(p) is None]):
        raise UserError(f"format=onnx needs {', '.join(missing)}: pip install -e '.[export]' (or format=torch_export)")
    plan = launch_plan(lay_out(cfg, 1))
    if plan.layout.world != 1:
        raise UserError("export runs one process: leave devices and num_nodes at 1")
    settle_weights(cfg)
    return plan


class Pixels(nn.Module):
    """uint8 images in, the net's logits out: the normalisation of the run's data, then the net."""

    def __init__(self, net: nn.Module, inference: dict):
        super().__init__()
        import torch

        self.net, self.value_range = net, float(inference["value_range"])
        shape = (1, -1, 1, 1)
        self.register_buffer("mean", torch.tensor(inference["mean"]).view(shape))
        self.register_buffer("std", torch.tensor(inference["std"]).view(shape))

    def forward(self, images):
        return self.net((images.float() / self.value_range - self.mean) / self.std)


def export(cfg: DictConfig) -> dict:
    import torch

    from starter.checkpointing.inference import load_for_inference
    from starter.run import start_process

    start_process(cfg)
    model, record = load_for_inference(Path(cfg.ckpt_path), list(cfg.model_config_dirs))
    net = getattr(model, "net", model)
    pixels = Pixels(net, record).eval()
    out = Path(cfg.paths.output_dir) / FORMATS[cfg.format]
    shape, generator = record["image_shape"], torch.Generator().manual_seed(int(cfg.seed))
    traced, check = (torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=generator) for n in (2, 3))
    batch = {"images": {0: torch.export.Dim("batch", min=1, max=4096)}}
    # ONNX keeps the weights inside the file up to its 2 GB protobuf limit; above it, in model.onnx.data beside it
    weights = sum(t.numel() * t.element_size() for t in (*pixels.parameters(), *pixels.buffers()))
    external = cfg.format == "onnx" and weights >= ONNX_INSIDE_LIMIT
    try:
        with torch.no_grad():
            if cfg.format == "onnx":
                torch.onnx.export(
                    pixels,
                    (traced,),
                    out,
                    input_names=["images"],
                    output_names=["logits"],
                    dynamic_shapes=batch,
                    dynamo=True,
                    external_data=external,
                    verbose=False,
                )
                import onnxruntime

                session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
                got = torch.from_numpy(session.run(None, {"images": check.numpy()})[0])
            else:
                torch.export.save(torch.export.export(pixels, (traced,), dynamic_shapes=batch), out)
                got = torch.export.load(out).module()(check)
            difference = float((got - pixels(check)).abs().max())
    except UserError:
        raise
    except Exception as err:
        discard(out)
        raise UserError(
            f"{type(net).__name__} does not export to {cfg.format}: {first_line(err, named=False)}"
        ) from err
    if not difference <= float(cfg.tolerance):
        discard(out)
        raise UserError(
            f"the {cfg.format} model's logits differ from the model's by {difference:.2g} (more than"
            f" tolerance={cfg.tolerance}); not kept"
        )
    c, h, w = shape
    beside = f" (its {weights / 1e9:.1f} GB of weights in {out.name}.data: move the two together)" if external else ""
    print(
        f"exported {shown(out)}{beside}: uint8 images (N, {c}, {h}, {w}) in, {len(record['classes'])} logits out;"
        f" checked on a batch of 3 against the model: largest difference {difference:.1e}",
        flush=True,
    )
    return {}


def discard(out: Path) -> None:
    """An export not kept leaves nothing: the file, and the weights ONNX may have written beside it."""
    out.unlink(missing_ok=True)
    out.with_name(f"{out.name}.data").unlink(missing_ok=True)
