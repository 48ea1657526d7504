"""The toy kernel's ABI for ksim (images/toy/README.md), and its hard cases.

Symbol names here are the contract between the kernel sources and every ksim
target; the kernel's tests check that each one exists in the built ELF.
"""

from __future__ import annotations

NAME = "toy"
ARCH = "x86_64"
ELF_NAME = "toy.elf"

#: virtual address the kernel is linked at, and its physical load address
LINK_ADDRESS = 0xFFFFFFFF81000000
LOAD_ADDRESS = 0x1000000
#: physical = virtual - START_KERNEL_MAP
START_KERNEL_MAP = 0xFFFFFFFF80000000

# --- entry, end, stack ---------------------------------------------------------
#: 64-bit entry; needs only RSP = INIT_STACK_TOP (unicorn starts here)
ENTRY = "ksim_entry64"
#: reaching it ends a run (unicorn stops there; under QEMU it writes the debug-exit port)
HALT = "ksim_halt"
INIT_STACK_TOP = "init_stack_top"
#: 32-bit PVH entry (XEN_ELFNOTE_PHYS32_ENTRY), used by QEMU's -kernel loader
PVH_ENTRY = "pvh_start32"

# --- ksim's memory -------------------------------------------------------------
PATCH_AREA = "ksim_patch_area"  # 1 MiB, rwx, right after .text, filled with int3
PATCH_AREA_END = "ksim_patch_area_end"
HEAP = "ksim_heap"  # 1 MiB, rw, zero at boot, never touched by the kernel
HEAP_END = "ksim_heap_end"

# --- trap dispatch (the kernel's own #BP handler uses it under QEMU) -----------
TRAP_TABLE = "ksim_trap_table"  # struct ksim_trap { u64 site; u64 patch; } [TRAP_SLOTS]
TRAP_COUNT = "ksim_trap_count"  # u64: entries [0, count) are searched
TRAP_SLOTS = 1024
TRAP_ENTRY_SIZE = 16
TRAP_HANDLER = "ksim_int3_entry"
#: builds and loads the IDT (x86: lidt) / sets VBAR_EL1 (arm64), called first by
#: ksim_entry64: before it returns, a trap reaches no handler and the kernel dies
TRAP_SETUP = "trap_init"

# --- kernel data layout ----------------------------------------------------------
CURRENT_TASK = "current_task"  # struct task_struct *
TASK_PID_OFFSET = "KSIM_TASK_PID_OFFSET"  # absolute symbol: offsetof(struct task_struct, pid)
TASK_PID_SIZE = 4
CPU_NUMBER = "cpu_number"  # int, always 0 (uniprocessor)
JIFFIES = "jiffies"
IRQ_TICKS = "irq_ticks"  # timer interrupts seen (QEMU only); not in the checksum

# --- the workload ------------------------------------------------------------------
WORKLOAD_SEED = "ksim_workload_seed"  # u64, written by the loader before start
WORKLOAD_ITERATIONS = "ksim_workload_iterations"  # u64
WORKLOAD_CHECKSUM = "ksim_workload_checksum"  # u64 result
WORKLOAD_DONE = "ksim_workload_done"  # u64, 1 once the checksum is stored
DEFAULT_SEED = 0x5EED0001

# --- the per-hit benchmark -----------------------------------------------------------
BENCH_CALLS = "ksim_bench_calls"  # u64: 0 runs the workload instead
BENCH_CYCLES = "ksim_bench_cycles"  # u64 result: rdtsc difference around the loop
BENCH_TARGET = "ksim_bench_target"

# --- QEMU ------------------------------------------------------------------------------
DEBUG_EXIT_IOBASE = 0xF4
#: QEMU's exit status after the kernel writes the debug-exit port: (value << 1) | 1
QEMU_EXIT_SUCCESS = 33
QEMU_EXIT_FAILURE = 35
#: serial line printed at the end of a workload run
CHECKSUM_LINE = r"toy: seed=0x(?P<seed>[0-9a-f]+) iterations=(?P<iterations>\d+) checksum=0x(?P<checksum>[0-9a-f]+)"

ABI_SYMBOLS = (
    ENTRY, HALT, INIT_STACK_TOP, PVH_ENTRY, PATCH_AREA, PATCH_AREA_END, HEAP, HEAP_END,
    TRAP_TABLE, TRAP_COUNT, TRAP_HANDLER, TRAP_SETUP, CURRENT_TASK, TASK_PID_OFFSET, CPU_NUMBER,
    JIFFIES, IRQ_TICKS, WORKLOAD_SEED, WORKLOAD_ITERATIONS, WORKLOAD_CHECKSUM, WORKLOAD_DONE,
    BENCH_CALLS, BENCH_CYCLES, BENCH_TARGET,
)

#: Functions that make splicing hard, by kind (each claim is checked by disassembly
#: in tests/test_toy_kernel.py).
HARD_CASES: dict[str, list[str]] = {
    # whole function shorter than a 5-byte jmp (all really called, mostly through tables)
    "short": [
        "e100_set_multicast_list",  # ret (1 byte), net_device_ops.ndo_set_rx_mode
        "ramfs_open",  # xor eax,eax; ret (3), file_operations.open
        "ramfs_release",  # xor eax,eax; ret (3), file_operations.release
        "__x64_sys_getuid",  # xor eax,eax; ret (3), sys_call_table
        "__x64_sys_getgid",
        "__x64_sys_sync",
        "task_pid_nr",  # mov eax,[rdi+0x10]; ret (4)
    ],
    # ends in (or contains) a jmp to the start of another function
    "tail_call": [
        "kmalloc", "kfree", "memmove", "ip_fast_csum", "close_fd", "ip_rcv", "ip_queue_xmit",
        "submit_bio", "schedule", "update_process_times", "tcp_current_mss", "__free_pages",
        "brd_submit_bio", "__x64_sys_read",
    ],
    # an indirect jmp through a table of addresses (dense switch)
    "jump_table": ["vsnprintf", "e100_exec_cmd", "tcp_set_state", "workload_step"],
    # a RIP-relative memory operand in the first 5 bytes
    "rip_relative_entry": ["do_timer", "get_jiffies_64"],
    # a branch targets entry+1..entry+4 (a loop head inside the first 5 bytes)
    "branch_near_entry": ["__sw_hweight64", "__memzero_qwords"],
    # calls itself
    "recursive": ["fib", "bst_insert", "bst_count", "bst_depth", "bst_sum"],
    # reached only through sys_call_table: no direct call or jmp anywhere
    "syscall_only": [
        "__x64_sys_read", "__x64_sys_write", "__x64_sys_open", "__x64_sys_close",
        "__x64_sys_lseek", "__x64_sys_fsync", "__x64_sys_sched_yield", "__x64_sys_getpid",
        "__x64_sys_getppid", "__x64_sys_getuid", "__x64_sys_getgid", "__x64_sys_sync",
        "__x64_sys_times", "__x64_sys_sendto", "__x64_sys_brk", "__x64_sys_sethostname",
        "__x64_sys_gettid", "__x64_sys_uname", "__x64_sys_ni_syscall",
    ],
}

#: the x86 toy's function names that its arm64 build gives Linux's arm64 names
#: (images/toy/include/asm-arm64.h): the syscall handlers, their dispatcher and
#: the stack switch; every other name is the same in both builds
ARM64_NAMES: dict[str, str] = {
    **{n: "__arm64_sys_" + n[len("__x64_sys_"):] for n in HARD_CASES["syscall_only"]},
    "do_syscall_64": "invoke_syscall",
    "__switch_to_asm": "cpu_switch_to",
}

#: the syscall table the "syscall_only" functions are reached through
SYSCALL_TABLE = "sys_call_table"

#: functions the workload reaches a seed-dependent number of times (for examples/tests)
WORKLOAD_FUNCTIONS = (
    "schedule", "context_switch", "__switch_to", "do_syscall_64", "__x64_sys_getpid",
    "__x64_sys_read", "__x64_sys_write", "kmem_cache_alloc", "kmem_cache_free", "kmalloc",
    "kfree", "__alloc_pages", "__free_pages", "vfs_read", "vfs_write", "submit_bio",
    "e100_xmit_frame", "e100_rx_clean", "e100_intr", "tcp_sendmsg", "tcp_sync_mss",
    "scheduler_tick", "update_process_times", "run_timer_softirq", "memcpy", "crc32_le", "fib",
)
