"""InputSlot: one key per place in the optimizer, made by its kind's constructor.

Bindings, guards, checks and warm-start records all key on InputSlot; two spellings of one
place would be two keys, and a field a kind does not use set by mistake was such a spelling.
"""

from __future__ import annotations

import pickle

import pytest

from hocompile.ir.graph import AttributeSlot, GroupSlot, InputSlot, ParamSlot, SharedSlot, StateSlot


@pytest.mark.parametrize(
    ("slot", "label", "where"),
    [
        (InputSlot.param(0, 2), "p0_2", "param_groups[0]['params'][2]"),
        (InputSlot.grad(1, 0), "g1_0", "param_groups[1]['params'][0].grad"),
        (InputSlot.state(0, 1, "exp_avg"), "s0_1_exp_avg", "state[param_groups[0]['params'][1]]['exp_avg']"),
        (InputSlot.param_attribute(0, 1, "main_grad"), "pa0_1_main_grad", "param_groups[0]['params'][1].main_grad"),
        (InputSlot.attribute("buf"), "a_buf", "optimizer attribute 'buf'"),
        (InputSlot.group_entry(1, "lr"), "gt1_lr", "param_groups[1]['lr']"),
        (InputSlot.shared(3), "shared3", "value 3 of the part of the step every param shares"),
        (InputSlot.graph_input(4), "in4", "input 4 of the graph torch.compile handed over"),
        (InputSlot.carry(1, 0), "c_read1_0", "value 0 computed before host read 1 (read1.0)"),
    ],
)
def test_each_kind_names_its_place(slot: InputSlot, label: str, where: str) -> None:
    assert slot.label() == label
    assert slot.describe() == where
    assert pickle.loads(pickle.dumps(slot)) == slot  # warm-start records pickle them


def test_leaves_members_and_wholes() -> None:
    state = InputSlot.state(0, 1, "Q")
    leaf = state.leaf_at(2, "[2]")
    assert (leaf.leaf, leaf.path, leaf.whole()) == (2, "[2]", state)
    assert leaf.describe() == "state[param_groups[0]['params'][1]]['Q'][2]"
    assert state.of_member(5) == InputSlot.state(0, 5, "Q")
    assert InputSlot.group_entry(0, "lr").leaf_at(0, "[0]").whole() == InputSlot.group_entry(0, "lr")


@pytest.mark.parametrize(
    ("kind", "fields"),
    [
        (AttributeSlot, (0, -1, "buf")),  # an optimizer attribute belongs to no group
        (GroupSlot, (0, 3, "lr")),  # a group entry belongs to no param
        (ParamSlot, (0, 1, "x")),  # a param has no key
        (ParamSlot, (-1, 1, "")),  # ... but a group
        (StateSlot, (0, -1, "m")),  # state is a param's
        (SharedSlot, (0, 1, "")),
    ],
)
def test_a_kind_refuses_fields_it_does_not_use(kind: type[InputSlot], fields: tuple) -> None:
    with pytest.raises(ValueError, match="InputSlot"):
        kind(*fields)


def test_kinds_are_classes_and_never_equal() -> None:
    assert isinstance(InputSlot.param(0, 1), ParamSlot) and InputSlot.param(0, 1).kind == "param"
    assert InputSlot.param(0, 1) != InputSlot.grad(0, 1)
    assert len({InputSlot.param(0, 1), InputSlot.grad(0, 1), InputSlot.param(0, 1)}) == 2
    with pytest.raises(TypeError, match="of a kind"):
        InputSlot(0, 1)
