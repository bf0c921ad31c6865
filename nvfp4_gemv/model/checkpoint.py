"""Reading a Hugging Face checkpoint folder's safetensors without trusting it: which tensors it holds, in
which file, of which dtype and shape (from the files' headers alone, nothing read), and the tensors
themselves onto a device, each file opened once. Shared by ``load_modelopt`` (``modelopt.py``) and
``from_pretrained`` (``pretrained.py``); needs the ``hf`` extra's safetensors for the reads.

The safetensors format (its documentation): 8 bytes, the little-endian length N of a JSON header, the header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, offsets relative to
the byte after the header), then the data. A folder holds ``model.safetensors`` or shards named by
``model.safetensors.index.json``'s ``weight_map``.

What is refused, each with a ``CheckpointError`` naming the folder, file or tensor and what to do: a folder
that does not exist, no safetensors file, a header that is not JSON or a file shorter than its header says
(a truncated download), an index naming a file that is missing or a tensor its shard does not hold, a
shard holding a tensor the index does not name, and a ``.safetensors`` file beside an index that does not
name it (a stale file of another export: loading would silently take one or the other).
"""

import json
import os
import shutil
import struct
import tempfile

import torch

INDEX = "model.safetensors.index.json"
QUANT_CONFIG = "hf_quant_config.json"  # ModelOpt's quantization config beside the weights
KV_SCALES = ("k_scale", "v_scale")  # ModelOpt's FP8 KV-cache scales of an attention module

# safetensors dtype names (its format's documentation) -> torch
DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
          "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
          "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn,
          "F8_E5M2": torch.float8_e5m2}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is; the message names the file, key or tensor."""


def fail(who, msg):
    raise CheckpointError(f"{who}: {msg}")


def read_json(path, who):
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        fail(who, f"{os.path.basename(path)} is not valid JSON: {e}")


def check_folder(path, who):
    """``path`` must be an existing folder (the messages say which of the two it is not)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{who}: 'path': expected a folder path (str or os.PathLike), got {type(path).__name__}")
    path = os.fspath(path)
    if not os.path.exists(path):
        fail(who, f"'{path}' does not exist (expected a checkpoint folder: config.json and safetensors)")
    if not os.path.isdir(path):
        fail(who, f"'{path}' is a file, not a checkpoint folder (give the folder that holds it)")
    return path


class Entry:
    """One tensor of a checkpoint, from its file's header: ``file``, ``dtype`` (a torch dtype, or the
    header's name where torch has none), ``shape`` (a tuple), ``nbytes``."""

    __slots__ = ("file", "dtype", "shape", "nbytes")

    def __init__(self, file, dtype, shape, nbytes):
        self.file, self.dtype, self.shape, self.nbytes = file, dtype, shape, nbytes

    def meta(self):
        """An empty tensor of this dtype and shape on the meta device (for validation without data)."""
        if not isinstance(self.dtype, torch.dtype):
            raise CheckpointError(f"dtype {self.dtype!r} has no torch dtype")
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


def read_header(path, who):
    """{name: Entry} of one safetensors file, from its header; a short file or a bad header raises naming it."""
    name = os.path.basename(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            fail(who, f"'{name}' is {size} bytes, shorter than a safetensors header: the file is truncated "
                      "(download or write it again)")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            fail(who, f"'{name}': its header says {n} bytes of header, the file has {size - 8} after the length: "
                      "the file is truncated (download or write it again)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        fail(who, f"'{name}': the safetensors header is not valid JSON ({e}): not a safetensors file, or damaged")
    if not isinstance(header, dict):
        fail(who, f"'{name}': the safetensors header is not a JSON object")
    data = size - 8 - n
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in v["data_offsets"])
            shape = tuple(int(s) for s in v["shape"])
            dt = v["dtype"]
        except (KeyError, TypeError, ValueError):
            fail(who, f"'{name}': the header's entry for tensor '{k}' is malformed: {v!r}")
        if end > data or begin > end:
            fail(who, f"'{name}': tensor '{k}' ends at byte {end} of the data, the file holds {data}: the file is "
                      "truncated (download or write it again)")
        out[k] = Entry(name, DTYPES.get(dt, dt), shape, end - begin)
    return out


class Checkpoint:
    """The safetensors of a checkpoint folder: ``entries`` ({tensor name: Entry}), ``files`` (the file names
    read, in order), ``path``. ``read(keys, device)`` loads tensors."""

    def __init__(self, path, who):
        self.path, self.who = path, who
        index = os.path.join(path, INDEX)
        present = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        entries = {}
        if os.path.exists(index):
            idx = read_json(index, who)
            wm = idx.get("weight_map") if isinstance(idx, dict) else None
            if not isinstance(wm, dict) or not all(isinstance(f, str) for f in wm.values()):
                fail(who, f"{INDEX}: key 'weight_map' missing or not an object of file names")
            by_file = {}
            for k, f in wm.items():
                by_file.setdefault(f, set()).add(k)
            stale = sorted(set(present) - set(by_file))
            if stale:
                fail(who, f"'{stale[0]}' is in {path} but {INDEX} does not name it: a stale file of another export? "
                          f"Remove it (or the index, if the index is the stale one); loading would take one or the other")
            for f, named in sorted(by_file.items()):
                if not os.path.exists(os.path.join(path, f)):
                    fail(who, f"{INDEX}: weight_map names '{f}', which is not in {path}")
                held = read_header(os.path.join(path, f), who)
                if named - set(held):
                    fail(who, f"{INDEX}: tensor '{sorted(named - set(held))[0]}' is mapped to '{f}', which does not hold it")
                if set(held) - named:
                    fail(who, f"tensor '{sorted(set(held) - named)[0]}' is in '{f}' but not in {INDEX}'s weight_map")
                entries.update(held)
            self.files = sorted(by_file)
        else:
            if not present:
                fail(who, f"{path}: no .safetensors file")
            for f in present:
                for k, e in read_header(os.path.join(path, f), who).items():
                    if k in entries:
                        fail(who, f"tensor '{k}' is in both {entries[k].file} and {f}")
                    entries[k] = e
            self.files = present
        self.entries = entries

    def nbytes(self):
        return sum(e.nbytes for e in self.entries.values())

    def read(self, keys, device, each=None, slices=None):
        """{name: tensor} of ``keys`` on ``device``, each file opened once (in ``files`` order, each file's keys
        in its own order). ``each(name, tensor)``, where given, is called as each tensor arrives and the tensor
        is not kept (the caller places it: a load then holds at most what the caller keeps). ``slices``:
        ``{name: index}`` (a tuple of slices, as ``tensor[index]`` takes it) for tensors of which only that
        part is read from the file (a tensor-parallel rank's shard)."""
        from safetensors import SafetensorError, safe_open

        wanted = {}
        for k in keys:
            wanted.setdefault(self.entries[k].file, []).append(k)
        out = {}
        for f in self.files:
            if f not in wanted:
                continue
            try:
                with safe_open(os.path.join(self.path, f), framework="pt", device=str(device)) as h:
                    for k in wanted[f]:
                        index = slices.get(k) if slices else None
                        t = h.get_tensor(k) if index is None else h.get_slice(k)[index].contiguous()
                        if each is None:
                            out[k] = t
                        else:
                            each(k, t)
            except SafetensorError as e:  # the header was read: the data is damaged, or the file changed since
                fail(self.who, f"'{f}': safetensors cannot read it ({e}); download or write it again")
        return out


# ----------------------------------------------------------------------------------------------------
# Writing a folder: all of the new export or none of it, never a mix with an older one
# ----------------------------------------------------------------------------------------------------


def existing_export(path, names=("hf_quant_config.json",)):
    """The files of an export in folder ``path`` (safetensors, their index, ``names``), sorted."""
    if not os.path.isdir(path):
        return []
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors") or f == INDEX or f in names)


def replace_export(path, writers, overwrite, who, owned=("hf_quant_config.json",)):
    """Writes an export into folder ``path``: ``writers`` ({file name: function(file path) that writes it}).

    A folder that already holds an export (``existing_export``: safetensors, an index, or one of ``owned``)
    is refused with ``FileExistsError`` naming a file, unless ``overwrite``; then the old export's files are
    replaced. Every new file is first written under a temporary folder inside ``path`` (same file system),
    then: the old export's files are removed (index first), the new ones renamed into place, the index last.
    A reader at any moment sees the old export, part of the new one (a missing tensor or file: an error), or
    the new one; never tensors of both (an index naming old shards beside new files loads silently wrong)."""
    os.makedirs(path, exist_ok=True)
    old = existing_export(path, owned)
    if old and not overwrite:
        raise FileExistsError(f"{who}: '{path}' already holds an export ('{old[0]}'"
                              + (f" and {len(old) - 1} more" if len(old) > 1 else "")
                              + "): pass overwrite=True to replace it, or write to another folder")
    stage = tempfile.mkdtemp(prefix=".nvfp4-write-", dir=path)
    try:
        for name, write in writers.items():
            write(os.path.join(stage, name))
        order = sorted(old, key=lambda f: (f != INDEX, f))  # the old index goes first
        for f in order + [f for f in writers if f not in old and os.path.exists(os.path.join(path, f))]:
            os.remove(os.path.join(path, f))
        for name in sorted(writers, key=lambda f: (f == INDEX, f.endswith(".safetensors"), f)):
            os.replace(os.path.join(stage, name), os.path.join(path, name))
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return path
