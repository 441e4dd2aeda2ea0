"""Data sets, the minibatch file format, and loaders."""

from ._dataset import DataSet, MultiDataSet, as_dataset
from ._files import list_minibatches, load_minibatch, save_dataset, save_minibatches

__all__ = [
    "DataSet",
    "MultiDataSet",
    "as_dataset",
    "save_minibatches",
    "save_dataset",
    "load_minibatch",
    "list_minibatches",
]
