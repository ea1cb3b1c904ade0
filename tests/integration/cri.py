"""The tests' kubelet: a CRI runtime.v1 client and the pod/container configs kubelet would send.

Resources are filled in as kubelet computes them (pkg/kubelet/cm/helpers_linux.go): shares =
milliCPU*1024/1000 (at least 2), quota = milliCPU*period/1000 with period 100000 µs, memory limit in bytes.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from cri_api.v1 import api_pb2 as pb
from cri_api.v1 import api_pb2_grpc as pbg

from .containerd import IMAGE

PERIOD_US = 100_000
NODE = pb.NamespaceMode.NODE


def shares(milli: int) -> int:
    return max(2, milli * 1024 // 1000)


def quota(milli: int, period: int = PERIOD_US) -> int:
    return max(1000, milli * period // 1000)


class CriClient:
    def __init__(self, socket_path: Path | str, timeout: float = 30):
        target = str(socket_path)
        self.channel = grpc.insecure_channel(target if target.startswith("unix:") else f"unix://{target}")
        self.runtime = pbg.RuntimeServiceStub(self.channel)
        self.image = pbg.ImageServiceStub(self.channel)
        self.timeout = timeout

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> CriClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class PodSpec:
    """What kubelet knows about a pod when it calls RunPodSandbox."""

    name: str
    qos: str = "Burstable"  # Guaranteed, Burstable, BestEffort
    namespace: str = "default"
    uid: str = field(default_factory=lambda: str(uuid.uuid4()))
    annotations: dict[str, str] = field(default_factory=dict)


def pod_config(spec: PodSpec, cgroup_parent: str, log_dir: Path) -> pb.PodSandboxConfig:
    log_dir.mkdir(parents=True, exist_ok=True)
    return pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=spec.name, uid=spec.uid, namespace=spec.namespace, attempt=0),
        # With host networking the hostname stays empty: the runtime would otherwise try to set it.
        log_directory=str(log_dir),
        labels={"io.kubernetes.pod.name": spec.name, "io.kubernetes.pod.namespace": spec.namespace,
                "io.kubernetes.pod.uid": spec.uid},
        annotations=dict(spec.annotations),
        linux=pb.LinuxPodSandboxConfig(
            cgroup_parent=cgroup_parent,
            security_context=pb.LinuxSandboxSecurityContext(
                namespace_options=pb.NamespaceOption(network=NODE, pid=pb.NamespaceMode.CONTAINER,
                                                     ipc=pb.NamespaceMode.POD)),
        ),
    )


def container_config(name: str, *, cpu_milli_request: int = 0, cpu_milli_limit: int = 0,
                     memory_limit: int = 0, command: list[str] | None = None,
                     annotations: dict[str, str] | None = None, image: str = IMAGE,
                     env: dict[str, str] | None = None) -> pb.ContainerConfig:
    res = pb.LinuxContainerResources(cpu_shares=shares(cpu_milli_request), oom_score_adj=0)
    if cpu_milli_limit:
        res.cpu_period = PERIOD_US
        res.cpu_quota = quota(cpu_milli_limit)
    if memory_limit:
        res.memory_limit_in_bytes = memory_limit
    return pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name, attempt=0),
        image=pb.ImageSpec(image=image),
        # A shell that exits at once on SIGTERM, so StopContainer does not wait for its timeout.
        command=command or ["sh", "-c", "trap 'exit 0' TERM; sleep 2147483647 & wait"],
        log_path=f"{name}.log",
        labels={"io.kubernetes.container.name": name},
        annotations=dict(annotations or {}),
        envs=[pb.KeyValue(key=k, value=v) for k, v in (env or {}).items()],
        linux=pb.LinuxContainerConfig(resources=res),
    )


def guaranteed(name: str, cpus_milli: int, memory: int = 64 << 20, **kw) -> pb.ContainerConfig:
    return container_config(name, cpu_milli_request=cpus_milli, cpu_milli_limit=cpus_milli, memory_limit=memory, **kw)


@dataclass
class RunningPod:
    spec: PodSpec
    sandbox_id: str
    config: pb.PodSandboxConfig
    containers: dict[str, str] = field(default_factory=dict)  # name -> container id


class Kubelet:
    """Drives pod lifecycles through a CRI endpoint, as kubelet does."""

    def __init__(self, client: CriClient, cgroup_parent_of, log_root: Path):
        self.c = client
        self.cgroup_parent_of = cgroup_parent_of  # (qos, uid) -> cgroup parent
        self.log_root = log_root
        self.pods: list[RunningPod] = []

    def run_pod(self, spec: PodSpec) -> RunningPod:
        cfg = pod_config(spec, self.cgroup_parent_of(spec.qos, spec.uid), self.log_root / spec.uid)
        r = self.c.runtime.RunPodSandbox(pb.RunPodSandboxRequest(config=cfg), timeout=self.c.timeout)
        pod = RunningPod(spec, r.pod_sandbox_id, cfg)
        self.pods.append(pod)
        return pod

    def create(self, pod: RunningPod, cfg: pb.ContainerConfig) -> str:
        r = self.c.runtime.CreateContainer(
            pb.CreateContainerRequest(pod_sandbox_id=pod.sandbox_id, config=cfg, sandbox_config=pod.config),
            timeout=self.c.timeout)
        pod.containers[cfg.metadata.name] = r.container_id
        return r.container_id

    def start(self, container_id: str) -> None:
        self.c.runtime.StartContainer(pb.StartContainerRequest(container_id=container_id), timeout=self.c.timeout)

    def run_container(self, pod: RunningPod, cfg: pb.ContainerConfig) -> str:
        cid = self.create(pod, cfg)
        self.start(cid)
        return cid

    def status(self, container_id: str, verbose: bool = False) -> pb.ContainerStatusResponse:
        return self.c.runtime.ContainerStatus(pb.ContainerStatusRequest(container_id=container_id, verbose=verbose),
                                              timeout=self.c.timeout)

    def stop_remove_container(self, container_id: str, timeout_s: int = 2) -> None:
        self.c.runtime.StopContainer(pb.StopContainerRequest(container_id=container_id, timeout=timeout_s),
                                     timeout=self.c.timeout)
        self.c.runtime.RemoveContainer(pb.RemoveContainerRequest(container_id=container_id), timeout=self.c.timeout)

    def stop_remove_pod(self, pod: RunningPod) -> None:
        for cid in list(pod.containers.values()):
            try:
                self.stop_remove_container(cid)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    raise
        self.c.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod.sandbox_id), timeout=self.c.timeout)
        self.c.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod.sandbox_id),
                                        timeout=self.c.timeout)
        if pod in self.pods:
            self.pods.remove(pod)

    def cleanup(self) -> None:
        for pod in list(self.pods):
            with contextlib.suppress(grpc.RpcError):
                self.stop_remove_pod(pod)

    def remove_all_pods(self, attempts: int = 10) -> list[str]:
        """Stop and remove every sandbox the runtime still lists (what a test's own cleanup missed, e.g. a
        RemovePodSandbox that failed while its containers were still exiting), retrying briefly.
        Returns the ids that could not be removed."""
        left: list[str] = []
        for _ in range(attempts):
            left = []
            for sb in self.c.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=self.c.timeout).items:
                try:
                    self.c.runtime.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sb.id),
                                                  timeout=self.c.timeout)
                    self.c.runtime.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sb.id),
                                                    timeout=self.c.timeout)
                except grpc.RpcError:
                    left.append(sb.id)
            if not left:
                return []
            time.sleep(0.5)
        return left
