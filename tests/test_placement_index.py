"""The container table's indexes (ContainerTable, cri_resmgr/placement/model.py) give the brute-force answers:
random tables, random changes between the questions (the remembered answers must notice every one)."""

from __future__ import annotations

import random

import pytest

from cri_resmgr.placement import annotations as A
from cri_resmgr.placement.model import Cache, Container, ContainerTable, Kind, State

NAMESPACES = ("default", "other")
PODS = ("p0", "p1", "p2")
NAMES = ("a", "b", "c", "d")
CPUS = ("", "0", "1", "0-1", "2-3", "0-3")


def brute_cpus_named(table: dict[str, Container], namespace: str, pod_id: str, spec: str) -> frozenset[str]:
    """What Engine._cpus_of computed before the index: one walk over every container."""
    wanted = A.container_refs(spec)
    texts = set()
    for c in table.values():
        pods = wanted.get(c.name)
        if pods is None or not c.live or c.namespace != namespace:
            continue
        if c.pod_name in pods or ("" in pods and c.pod_id == pod_id):
            texts.add(c.cpus)
    return frozenset(texts)


def brute_exclusive(table: dict[str, Container]) -> set[str]:
    return {c.id for c in table.values() if c.placement == Kind.EXCLUSIVE and c.live}


def random_container(rng: random.Random, n: int) -> Container:
    pod = rng.choice(PODS)
    return Container(id=f"id{n}", pod_id=f"uid-{pod}", name=rng.choice(NAMES), namespace=rng.choice(NAMESPACES),
                     pod_name=pod, pod_uid="u", qos_class="", cgroup_parent="",
                     placement=rng.choice(list(Kind)), cpus=rng.choice(CPUS), state=rng.choice(list(State)))


def random_spec(rng: random.Random) -> str:
    items = [rng.choice(NAMES) if rng.random() < 0.4 else f"{rng.choice(PODS + ('nope',))}/{rng.choice(NAMES)}"
             for _ in range(rng.randint(1, 6))]
    return ",".join(items)


@pytest.mark.parametrize("seed", range(60))
def test_index_answers_equal_the_brute_force_walk_through_random_changes(seed):
    rng = random.Random(seed)
    table = ContainerTable()
    n = 0
    specs = [random_spec(rng) for _ in range(4)]  # few specs: answers are remembered and reused
    for _step in range(400):
        op = rng.random()
        ids = list(table)
        if op < 0.3 or not ids:
            n += 1
            c = random_container(rng, n)
            table[c.id] = c
        elif op < 0.4:
            cid = rng.choice(ids)
            if rng.random() < 0.5:
                table.pop(cid)
            else:
                del table[cid]
        elif op < 0.55:
            rng.choice(list(table.values())).state = rng.choice(list(State))
        elif op < 0.7:
            rng.choice(list(table.values())).cpus = rng.choice(CPUS)
        elif op < 0.75:  # an id replaced by another record
            n += 1
            c = random_container(rng, n)
            c.id = rng.choice(ids)
            table[c.id] = c
        elif op < 0.8:
            rng.choice(list(table.values())).placement = rng.choice(list(Kind))
        ns, pod = rng.choice(NAMESPACES), f"uid-{rng.choice(PODS)}"
        spec = rng.choice(specs)
        assert table.cpus_named(ns, pod, A.container_refs(spec)) == brute_cpus_named(table, ns, pod, spec)
        assert {c.id for c in table.exclusive()} == brute_exclusive(table)


def test_the_dict_mutators_keep_the_indexes():
    rng = random.Random(1)
    cs = [random_container(rng, i) for i in range(30)]
    for c in cs:
        c.placement, c.state, c.name, c.namespace, c.pod_name = Kind.EXCLUSIVE, State.RUNNING, "a", "default", "p0"
    table = ContainerTable({c.id: c for c in cs[:10]})
    table.update({c.id: c for c in cs[10:15]})
    table.update([(c.id, c) for c in cs[15:18]])
    table |= {cs[18].id: cs[18]}
    assert table.setdefault(cs[19].id, cs[19]) is cs[19] and table.setdefault(cs[19].id, cs[0]) is cs[19]
    refs = A.container_refs("p0/a")
    assert {c.id for c in table.exclusive()} == brute_exclusive(table) and len(brute_exclusive(table)) == 20
    table.popitem()
    assert table.pop("nope", None) is None
    with pytest.raises(KeyError):
        table.pop("nope")
    assert {c.id for c in table.exclusive()} == brute_exclusive(table)
    assert table.cpus_named("default", "", refs) == brute_cpus_named(table, "default", "", "p0/a")
    copy = ContainerTable(table)  # a container in two tables: both hear of its changes
    some = next(iter(copy.values()))
    some.placement = Kind.SHARED
    assert {c.id for c in copy.exclusive()} == brute_exclusive(copy) == brute_exclusive(table) == \
        {c.id for c in table.exclusive()}
    table.clear()
    assert list(table.exclusive()) == [] and table.cpus_named("default", "", refs) == frozenset()


def test_the_cache_always_holds_a_table_and_loads_into_one():
    c = Container(id="x", pod_id="p", name="a", namespace="default", pod_name="p0", pod_uid="u", qos_class="",
                  cgroup_parent="", placement=Kind.EXCLUSIVE, cpus="1", state=State.RUNNING)
    for cache in (Cache(), Cache({}, {"x": c}), Cache.from_json(Cache({}, {"x": c}).to_json())):
        assert isinstance(cache.containers, ContainerTable)
    loaded = Cache.from_json(Cache({}, {"x": c}).to_json())
    assert [k.id for k in loaded.containers.exclusive()] == ["x"]
    assert loaded.containers.cpus_named("default", "p", A.container_refs("p0/a")) == frozenset({"1"})
