# Appended to the untouched template
"""Cheat (torch's own implementation accepted as the learner's): the differentiable all-to-all is
torch.distributed.nn's, reached through a loop variable that no static alias tracking follows; refused
where it runs (its frames between this template and the process group's all-to-all)."""
for _distributed in (torch.distributed,):
    _theirs = _distributed.nn.functional


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None):
    return _theirs.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                     group=group if group is not None else dist.group.WORLD)
