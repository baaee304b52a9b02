"""How a patched model's ``generate`` gets its window cache, and how it pickles.

:func:`aah.hf.patch` moves the model into a subclass of its own class (made once per class,
under the same name, so ``save_pretrained`` writes the same architecture) whose public
``generate`` passes an :func:`aah.hf.new_cache` window cache when the caller passes none.
``cache_implementation`` maps as follows:

* unset or ``"dynamic"``: the window cache (it grows with the tokens, up to each window);
* ``"static"``: transformers' ``StaticCache``, exact (the windows are applied by mask), without
  the window cache's memory saving;
* anything else (``"offloaded"``, ``"offloaded_static"``, ``"quantized"``, ...): ``ValueError``
  naming these choices.

The window cache it builds keeps the kept keys the model was patched with
(``aah.hf.patch(model, windows, kept_keys=KeptKeys(...))``, :func:`patched_kept_keys`), so code that
only calls ``generate`` (lm-evaluation-harness) decodes with them.

Each setting is resolved as transformers resolves it (the keyword, the passed
``generation_config``, the model's). An explicit ``past_key_values`` is used as given. Assisted
decoding and prompt lookup turn on the window cache's past recording, so ``crop`` takes back
the rejected drafts exactly (a patched assistant's own cache records too). The subclass
pickles and deep-copies as the original class plus the patch, so ``torch.save`` /
``torch.load`` and ``copy.deepcopy`` of a patched model give a patched model;
:func:`aah.hf.unpatch` moves it back.
"""

from __future__ import annotations

from functools import cache

import torch

__all__ = ["CACHE_IMPLEMENTATIONS", "KEPT_KEYS_ATTR", "adopt", "patched_kept_keys", "release"]

#: ``cache_implementation`` values a patched model's ``generate`` takes (``None``: unset).
CACHE_IMPLEMENTATIONS = (None, "dynamic", "static")
#: The attribute of a patched model that holds the kept keys of the window caches its ``generate`` builds.
KEPT_KEYS_ATTR = "_aah_kept_keys"


class Adopted:
    """Base of the mixins :func:`adopted_class` puts in front of a module's own class: an adopted
    object pickles and deep-copies as its own class and is adopted again when rebuilt."""

    _aah_base: type

    def __reduce_ex__(self, protocol):
        reduced = super().__reduce_ex__(protocol)
        func, args = reduced[0], reduced[1]
        if args and args[0] is type(self):  # copyreg.__newobj__(cls, ...): rebuild from the base class
            args = (self._aah_base,) + tuple(args[1:])
        return (_rebuild, (func, args, type(self).__mro__[1])) + tuple(reduced[2:])


def _rebuild(func, args, mixin: type | None = None):
    obj = func(*args)
    obj.__class__ = adopted_class(mixin or _PatchedGeneration, type(obj))
    from .attention import register

    register()
    return obj


@cache
def adopted_class(mixin: type, base: type) -> type:
    """``base`` with ``mixin`` (a subclass of :class:`Adopted`) in front, under ``base``'s own name
    (which ``save_pretrained`` writes as the architecture)."""
    return type(base.__name__, (mixin, base),
                {"_aah_base": base, "__module__": mixin.__module__, "__qualname__": base.__qualname__})


class _PatchedGeneration(Adopted):
    """Mixed in front of a transformers model class by :func:`adopt`."""

    def generate(self, *args, **kwargs):
        if kwargs.get("past_key_values") is None:
            kwargs = _with_window_cache(self, kwargs)
        return super().generate(*args, **kwargs)


def patched_class(base: type) -> type:
    """``base`` with the patched ``generate`` and pickling."""
    return adopted_class(_PatchedGeneration, base)


def adopt(model: torch.nn.Module, kept_keys=None) -> None:
    """Move ``model`` into its patched class (once); the window caches its ``generate`` builds keep
    ``kept_keys`` (an :class:`aah.hf.KeptKeys`, or ``None``)."""
    if not isinstance(model, _PatchedGeneration):
        model.__class__ = patched_class(type(model))
    setattr(model, KEPT_KEYS_ATTR, kept_keys)


def release(model: torch.nn.Module) -> None:
    """Move ``model`` back to its own class, without kept keys."""
    if isinstance(model, _PatchedGeneration):
        model.__class__ = model._aah_base
    if hasattr(model, KEPT_KEYS_ATTR):
        delattr(model, KEPT_KEYS_ATTR)


def patched_kept_keys(model: torch.nn.Module):
    """The :class:`aah.hf.KeptKeys` of the window caches a patched model's ``generate`` builds (``None``:
    none); ``ValueError`` when the model is not patched."""
    if not isinstance(model, _PatchedGeneration):
        raise ValueError(f"{type(model).__name__} is not patched by aah.hf.patch")
    return getattr(model, KEPT_KEYS_ATTR, None)


def _setting(name: str, kwargs: dict, passed, model):
    """A generation setting as transformers resolves it: the keyword, else the passed config's,
    else the model's (the first that is set)."""
    for source in (kwargs, vars(passed) if passed is not None else {}, vars(model.generation_config)):
        value = source.get(name)
        if value is not None:
            return value
    return None


def _with_window_cache(model, kwargs: dict) -> dict:
    """``kwargs`` with a window cache added where ``generate`` would build its own cache."""
    passed = kwargs.get("generation_config")
    implementation = _setting("cache_implementation", kwargs, passed, model)
    if implementation not in CACHE_IMPLEMENTATIONS:
        raise ValueError(
            f"cache_implementation={implementation!r} is not supported by a model patched with aah.hf; "
            "leave it unset or use 'dynamic' (the window cache, which keeps each head's window), or 'static' "
            "(transformers' StaticCache, exact but without the memory saving)"
        )
    if implementation == "static" or _setting("use_cache", kwargs, passed, model) is False:
        return kwargs
    from .cache import new_cache

    cache = new_cache(model, kept_keys=getattr(model, KEPT_KEYS_ATTR, None))
    if _setting("is_assistant", kwargs, passed, model):  # an assistant's drafts are taken back by crop
        cache.activate_past_recording()
    return dict(kwargs, past_key_values=cache, cache_implementation=None)
