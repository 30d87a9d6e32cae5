"""What the tests and the benches share, in one package: the cluster fixture (`cluster`),
the small run spec (`specs`), the Runs API helpers (`runs`), the planted-drift runs
(`drift`), the hand-made Voting batch (`batches`), a held RunExecutor (`held_runs`), a
task and its answer (`tasks`), the sandbox server (`sandbox`), the Helm chart and the
container images (`chart`, `containers`), a recorded Kubernetes API (`fake_kube`), the
bring-your-own-task runs (`byo`), an RPC called by name alone (`raw_grpc`), the tiny
models of the LoRA and learner-step tests (`lora_models`, `learner_step`), replicas that
take pushes (`push_replicas`), and the loopback gRPC, worker-loop, loop-tick and
scripted-workflow helpers.

Importable as `tests.support` from the repository root (pytest's `pythonpath`, and the
editable install's path entry for the benches, the service processes and torchrun's
ranks). No test module imports another test module (tests/unit/test_module_names.py)."""
