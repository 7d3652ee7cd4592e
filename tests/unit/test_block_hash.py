import subprocess
import sys

from pdserve.common.kv.block_hash import chain_seed, hash_blocks


def test_chained_and_salted():
    seed = chain_seed("model-a", 4)
    a = hash_blocks(seed, list(range(10)), 4)
    assert len(a) == 2  # only full blocks
    b = hash_blocks(seed, [0, 1, 2, 3, 9, 9, 9, 9], 4)
    assert a[0] == b[0] and a[1] != b[1]
    assert hash_blocks(chain_seed("model-a", 4, "tenant"), list(range(8)), 4)[0] != a[0]
    assert hash_blocks(chain_seed("model-b", 4), list(range(8)), 4)[0] != a[0]
    assert hash_blocks(chain_seed("model-a", 8), list(range(8)), 8)[0] != a[0]
    # a change in block 0 changes every later hash (chain)
    c = hash_blocks(seed, [7, 1, 2, 3, 4, 5, 6, 7], 4)
    assert c[1] != a[1]
    # incremental extension equals the one-shot computation
    tail = hash_blocks(seed, list(range(12)), 4, start=2, parent=a[1])
    assert a + tail == hash_blocks(seed, list(range(12)), 4)


def test_same_in_another_process():
    code = ("from pdserve.common.kv.block_hash import chain_seed, hash_blocks;"
            "print(hash_blocks(chain_seed('m', 4, 's'), list(range(8)), 4)[1].hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == hash_blocks(chain_seed("m", 4, "s"), list(range(8)), 4)[1].hex()
