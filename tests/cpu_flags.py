"""/proc/cpuinfo `flags` lines of each x86 CPU class, as cloud VMs show them, for tests that decide for a CPU
this machine is not. AMX cannot run here (qemu's TCG emulates no AMX), so the AMX class is tested by its flags
and its kernels only run on a real one."""

SAPPHIRE_RAPIDS_FLAGS = (
    "flags : fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse "
    "sse2 ss ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid "
    "tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt "
    "tsc_deadline_timer aes xsave avx f16c rdrand hypervisor lahf_lm abm 3dnowprefetch invpcid_single "
    "ssbd ibrs ibpb stibp ibrs_enhanced fsgsbase tsc_adjust bmi1 hle avx2 smep bmi2 erms invpcid rtm "
    "avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl "
    "xsaveopt xsavec xgetbv1 xsaves avx_vnni avx512_bf16 wbnoinvd arat avx512vbmi umip pku ospke waitpkg "
    "avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg tme avx512_vpopcntdq rdpid cldemote "
    "movdiri movdir64b md_clear serialize tsxldtrk amx_bf16 avx512_fp16 amx_tile amx_int8 flush_l1d "
    "arch_capabilities")  # Intel Xeon 4th gen: AMX-BF16, AMX-INT8
ZEN3_FLAGS = (
    "flags : fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse "
    "sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl nonstop_tsc cpuid "
    "extd_apicid tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes "
    "xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy cr8_legacy abm sse4a misalignsse 3dnowprefetch "
    "osvw topoext invpcid_single ssbd ibrs ibpb stibp vmmcall fsgsbase tsc_adjust bmi1 avx2 smep bmi2 "
    "erms invpcid rdseed adx smap clflushopt clwb sha_ni xsaveopt xsavec xgetbv1 xsaves clzero xsaveerptr "
    "rdpru wbnoinvd arat npt nrip_save umip pku ospke vaes vpclmulqdq rdpid fsrm")  # AMD EPYC Milan: AVX2 only
ZEN4_FLAGS = ZEN3_FLAGS + (" avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512_bf16 avx512vbmi "
                           "avx512_vbmi2 gfni avx512_vnni avx512_bitalg avx512_vpopcntdq")
ZEN5_FLAGS = ZEN4_FLAGS + " avx_vnni avx512_vp2intersect"  # this project's own CPU (AMD EPYC, family 26)
SKYLAKE_X_FLAGS = ZEN3_FLAGS + " avx512f avx512dq avx512cd avx512bw avx512vl"  # AVX-512 without VNNI or bf16
PRE_AVX2_FLAGS = "flags : fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx"  # Sandy Bridge: AVX, no AVX2
