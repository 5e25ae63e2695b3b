"""What a lazy table's checkpoint (``weight.ids``/``weight.rows``) and its optimizer state
(``ids``) must be to load: checked on the trainer before any server is written, as torch
checks a state_dict's shapes before copying (pure checks; the refusal path of a load is tested
with a world in test_table_checkpoints.py)."""

from types import SimpleNamespace

import torch

from remote_module.ps.tables._checkpoints import TableCheckpoints

TABLE = SimpleNamespace(num_embeddings=10, embedding_dim=2)


def misfit(ids, rows):
    return TableCheckpoints._misfit(TABLE, ids, {"rows": rows})


def test_ids_that_fit_load():
    assert misfit(torch.tensor([0, 3, 9]), torch.zeros(3, 2)) is None
    assert misfit(torch.empty(0, dtype=torch.long), torch.zeros(0, 2)) is None


def test_an_id_given_twice_is_refused_naming_it():
    # which of its two rows would win is undefined (servers scatter in any order)
    got = misfit(torch.tensor([4, 1, 4, 7]), torch.zeros(4, 2))
    assert got is not None and "more than once" in got and "4" in got, got


def test_ids_out_of_range_and_rows_of_another_shape_are_refused():
    assert "num_embeddings=10" in misfit(torch.tensor([0, 10]), torch.zeros(2, 2))
    assert "the table needs (2, 2)" in misfit(torch.tensor([0, 1]), torch.zeros(2, 3))
    assert "1-D tensor of row ids" in misfit(torch.tensor([0.0, 1.0]), torch.zeros(2, 2))
