"""Parallelism applied from outside to a built model (torch.distributed only: DeviceMesh, DTensor,
FSDP2, pipelining, DCP). The pieces, in the order a training script meets them:

    init_distributed()                                   mesh.py   (torchrun env://; nccl or gloo)
    mesh = build_mesh(parallel_config, model.cfg)        mesh.py   (validates the layout first)
    model = parallelize(model, parallel_config, mesh)    parallelize.py: TP → EP → recompute → compile → FSDP
    with loss_context(mesh["tp"]): loss.backward()       tp.py     (vocab-parallel loss under TP)
    runner = PipelineRunner(model, parallel_config, mesh); runner.step(input_ids, labels)    pp.py
    save_checkpoint(root, step, modules, optimizers) / load_checkpoint(...)   train/checkpoint.py (any layout → any)
    AutoParallel(model).hsdp(2).tp(2).build()  /  .pipeline("DualPipeV", microbatches=8)   auto.py

Data: data-parallel rank mesh["dp"].get_local_rank() of mesh["dp"].size() takes its slice of the
global batch; TP ranks of one dp rank see the same slice.
"""
