"""Data sets, the minibatch file format, loaders, and the data-source registry."""

from ._dataset import DataSet, MultiDataSet, as_dataset
from ._files import list_minibatches, load_minibatch, save_dataset, save_minibatches
from ._frames import frame_columns, keyed_rows, parquet_columns  # registers the DataFrame source
from ._sources import (Minibatches, Source, SourceContext, evaluation_parts, fit_minibatches, load_ref,
                       path_minibatches, register_source, unregister_source)

__all__ = [
    "DataSet",
    "MultiDataSet",
    "as_dataset",
    "save_minibatches",
    "save_dataset",
    "load_minibatch",
    "list_minibatches",
    "Source",
    "SourceContext",
    "Minibatches",
    "register_source",
    "unregister_source",
    "fit_minibatches",
    "path_minibatches",
    "evaluation_parts",
    "load_ref",
    "frame_columns",
    "parquet_columns",
    "keyed_rows",
]
