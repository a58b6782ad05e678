# Appended to the untouched template (tests/test_cheats.py: cheat_file).
# Cheat: take the bench's given copies of 1.6-1.8 from distlab.lessons.sync (the TODOs left untouched):
# the definitions below replace the template's three TODO functions.

# --- the cheat: the bench's given copies in place of 1.6-1.8 -------------------------------------
from distlab.lessons.sync import allreduce_gradients as _allreduce, average_buffers, broadcast_module  # noqa: E402


def broadcast_parameters(model, src=0, group=None):  # noqa: F811
    broadcast_module(model, group=group)


def allreduce_gradients(model, group=None):  # noqa: F811
    _allreduce([p for p in model.parameters() if p.requires_grad], group=group)


def sync_buffers(model, group=None):  # noqa: F811
    average_buffers(model, group=group)
