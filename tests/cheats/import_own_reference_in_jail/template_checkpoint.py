# Appended to the untouched template
"""Cheat: import the reference of its own exercise (4.1's save_file) from the solutions the grading jail holds.

Some graded tests build on the reference's modules (distlab/grading/jail.py's BUILDING_BLOCKS: checkpoint is
one), so the jail holds a copy of them. torch.hub's module loader imports a file by path; its reads happen
inside importlib (the audit hook does not charge a library's import to the learner), the lint allows torch,
and the loader's check of module names as strings does not read "./solutions/..." as one.
On main cb77d5e this scored 4.1's points with no code of its own. In 4.1's jail the reference's checkpoint
module comes without 4.1's region: the save_file taken from it raises, naming the missing reference.
"""
# Named as a module already in sys.modules: the reference's dataclasses look their module up there.
_reference = torch.hub._import_module("torch", "./solutions/phase4_production/checkpoint.py")  # "./": no module name
save_file = _reference.save_file
