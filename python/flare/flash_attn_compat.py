"""Run code written against flash_attn 2.x unchanged: install() makes `import flash_attn` resolve to flare.

    import flare.flash_attn_compat
    flare.flash_attn_compat.install()      # opt-in, once per process; never done on `import flare`
    from flash_attn import flash_attn_func  # flare's

What resolves after install():
  flash_attn                        __version__ "2.8.3+flare<version>" and the seven functions below
  flash_attn.flash_attn_interface   flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func,
                                    flash_attn_varlen_func, flash_attn_varlen_qkvpacked_func,
                                    flash_attn_varlen_kvpacked_func, flash_attn_with_kvcache
  flash_attn.bert_padding           unpad_input, pad_input, index_first_axis, index_put_first_axis
  flash_attn.layers.rotary          apply_rotary_emb (plain torch, flare.rotary), apply_rotary_emb_func
and importlib.metadata.version("flash_attn") gives the same version, so version checks pass. Another
flash_attn module (flash_attn.ops, flash_attn.modules, ...) raises ModuleNotFoundError naming what exists.

The functions follow flash-attn 2 where flare's own convention differs: a query row that sees no key has
softmax_lse +inf here, as in flash-attn 2, and -inf in flare's own functions (docs/semantics.md lists
every difference). install() refuses, with RuntimeError, when a real flash_attn is importable or installed:
the real one should win, and two of them in a process would be a trap. uninstall() undoes install().
"""

import functools
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import math
import re
import sys
import types
from pathlib import Path

from . import __version__, bert_padding, flash_attn_interface, rotary

__all__ = ["FLASH_ATTN_VERSION", "VERSION", "install", "installed", "uninstall"]

FLASH_ATTN_VERSION = "2.8.3"  # the flash-attn release whose API the functions follow
VERSION = f"{FLASH_ATTN_VERSION}+flare{__version__}"  # what flash_attn.__version__ and the metadata say

_FUNCTIONS = flash_attn_interface.__all__
_MARK = "__flare_compat__"


def _fa2_lse(lse):
    # flash-attn 2 writes +inf as the LSE of a row with no visible key (its softmax sum is 0); flare writes -inf.
    return lse.masked_fill(lse == -math.inf, math.inf)


def _fa2(fn):
    """fn with flash-attn 2's LSE convention on every softmax_lse it returns (always the tuple's second item)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        result = fn(*args, **kwargs)
        if isinstance(result, tuple):
            result = (result[0], _fa2_lse(result[1]), *result[2:])
        return result

    wrapper.__doc__ = (fn.__doc__ or "") + "\n\nflash_attn compatibility: an empty row's softmax_lse is +inf."
    return wrapper


class _Loader(importlib.abc.Loader):
    """Hands out the module objects install() built (for an import after a module left sys.modules)."""

    def create_module(self, spec):
        return _modules[spec.name]

    def exec_module(self, module):
        pass


class _Finder(importlib.metadata.DistributionFinder):
    """Finds the compat modules, refuses other flash_attn modules, and answers importlib.metadata for them."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in _modules:
            return _modules[fullname].__spec__
        if fullname.startswith("flash_attn."):
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: flare's flash_attn compatibility layer provides "
                + ", ".join(sorted(_modules)), name=fullname)
        return None

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        name = context.name
        if name is None or re.sub(r"[-_.]+", "_", name).lower() == "flash_attn":
            return iter([_Distribution()])
        return iter(())


class _Distribution(importlib.metadata.Distribution):
    """The metadata of the stand-in distribution "flash_attn" (name, version, top-level package)."""

    _FILES = {
        "METADATA": f"Metadata-Version: 2.1\nName: flash_attn\nVersion: {VERSION}\n"
                    "Summary: flash_attn API provided by flare (flare.flash_attn_compat)\n",
        "top_level.txt": "flash_attn\n",
    }

    def read_text(self, filename):
        return self._FILES.get(filename)

    def locate_file(self, path):
        return Path(__file__).parent / path


_modules = {}
_finder = None


def _module(name, doc, attrs, package=False):
    module = types.ModuleType(name, doc)
    module.__file__ = __file__
    module.__spec__ = importlib.machinery.ModuleSpec(name, _Loader(), origin=__file__, is_package=package)
    if package:
        module.__path__ = []
    setattr(module, _MARK, True)
    for key, value in attrs.items():
        setattr(module, key, value)
    module.__all__ = [k for k in attrs if not k.startswith("_")]
    return module


def _build():
    functions = {name: _fa2(getattr(flash_attn_interface, name)) for name in _FUNCTIONS}
    interface = _module("flash_attn.flash_attn_interface", "flash-attn 2.x functions, provided by flare.",
                        functions)
    padding = _module("flash_attn.bert_padding", "flash-attn 2.x padding helpers, provided by flare.",
                      {name: getattr(bert_padding, name) for name in bert_padding.__all__})
    rotary_module = _module("flash_attn.layers.rotary", "flash-attn 2.x rotary embedding (torch), provided by flare.",
                            {"apply_rotary_emb": rotary.apply_rotary_emb,
                             "apply_rotary_emb_func": rotary.apply_rotary_emb})
    layers = _module("flash_attn.layers", "flash_attn.layers, provided by flare.", {"rotary": rotary_module},
                     package=True)
    top = _module("flash_attn", f"flash_attn {VERSION}: the flash-attn 2.x API provided by flare "
                  "(flare.flash_attn_compat).",
                  {"__version__": VERSION, **functions, "flash_attn_interface": interface,
                   "bert_padding": padding, "layers": layers}, package=True)
    return {m.__name__: m for m in (top, interface, padding, layers, rotary_module)}


def _real_flash_attn():
    """Where a real flash_attn is, or None."""
    loaded = sys.modules.get("flash_attn")
    if loaded is not None:
        return None if getattr(loaded, _MARK, False) else f"already imported from {getattr(loaded, '__file__', '?')}"
    spec = importlib.util.find_spec("flash_attn")
    if spec is not None:
        return f"importable from {spec.origin or list(spec.submodule_search_locations or [])}"
    for name in ("flash_attn", "flash-attn"):
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return f"distribution {name} {dist.version} installed"
    return None


def installed():
    """Whether install() is in effect in this process."""
    return _finder is not None


def install():
    """Makes flash_attn, flash_attn.flash_attn_interface, flash_attn.bert_padding and flash_attn.layers.rotary
    (and importlib.metadata's "flash_attn") resolve to flare in this process. Idempotent. Raises RuntimeError
    when a real flash_attn is importable or installed, and changes nothing then."""
    global _finder
    if installed():
        return
    real = _real_flash_attn()
    if real is not None:
        raise RuntimeError(f"flare.flash_attn_compat.install(): a real flash_attn is {real}; use it, or "
                           "uninstall it (pip uninstall flash_attn) to run flash_attn code on flare")
    _modules.update(_build())
    sys.modules.update(_modules)
    _finder = _Finder()
    sys.meta_path.insert(0, _finder)
    importlib.invalidate_caches()


def uninstall():
    """Undoes install(): the flash_attn modules leave sys.modules and the finder leaves sys.meta_path.
    Code that already imported functions from them keeps them. A no-op when not installed."""
    global _finder
    if not installed():
        return
    for name, module in _modules.items():
        if sys.modules.get(name) is module:
            del sys.modules[name]
    _modules.clear()
    sys.meta_path.remove(_finder)
    _finder = None
    importlib.invalidate_caches()
