"""A GGUF file written again with its matrices in another GGML type (gguf's own numpy quantizers): a Q8_0 copy of
the default SmolLM2 (whose matrices are Q4_1) for the Q8_0 path's tests and benchmarks, no model hub needed.

    python -m sgjax.model.gguf_write SRC.gguf DST.gguf --type Q8_0
"""

from __future__ import annotations

import argparse
from typing import Callable

import numpy as np

# general.file_type (llama.cpp's LLAMA_FTYPE_MOSTLY_*) of a file whose matrices are mostly of the type
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "BF16": 32}


def requantize(src: str, dst: str, qtype: str = "Q8_0", which: Callable[[str], bool] | None = None) -> None:
    """Write `src` to `dst` with each 2-D tensor `which(name)` selects (default: all of them) stored as `qtype`,
    from its float32 values; the metadata and every other tensor are copied as they are."""
    import gguf

    target = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[target][0]
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue  # the writer's own
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub)
    writer.add_file_type(FILE_TYPES.get(qtype, FILE_TYPES["F32"]))
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # numpy order
        if len(shape) == 2 and shape[-1] % block == 0 and (which is None or which(t.name)):
            values = gguf.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
            writer.add_tensor(t.name, gguf.quants.quantize(values, target), raw_dtype=target)
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--type", default="Q8_0", choices=sorted(FILE_TYPES), help="the matrices' GGML type")
    args = ap.parse_args(argv)
    requantize(args.src, args.dst, args.type)


if __name__ == "__main__":
    main()
