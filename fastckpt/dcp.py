"""fastckpt on ``torch.distributed.checkpoint`` (DCP): write (and read) fastckpt checkpoints through DCP.

Save::

    import torch.distributed.checkpoint as dcp
    from fastckpt.dcp import FastCkptSavePlanner, FastCkptStager, FastCkptWriter, background_group

    dcp.save(state, storage_writer=FastCkptWriter(path), planner=FastCkptSavePlanner())
    fut = dcp.async_save(state, storage_writer=FastCkptWriter(path2), planner=FastCkptSavePlanner(),
                         async_stager=FastCkptStager(), process_group=background_group())

The folder holds HF-layout safetensors files of full tensors (readable by ``safetensors`` and
``transformers``), written in parallel by the ranks that own the bytes; see docs/FORMAT.md.
Pass ``process_group=background_group()`` to ``dcp.async_save`` so its collectives never share
the training group. A thin re-export: the code lives in :mod:`fastckpt.saving.dcp_writer`,
:mod:`fastckpt.saving.dtensor_save` and :mod:`fastckpt.saving.dtensor`.
"""

from .saving.dcp_writer import FastCkptSavePlanner, FastCkptWriter
from .saving.dtensor import background_group
from .saving.dtensor_save import FastCkptStager

__all__ = ["FastCkptWriter", "FastCkptSavePlanner", "FastCkptStager", "background_group"]
