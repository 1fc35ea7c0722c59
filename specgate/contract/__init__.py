"""The result contract: artifacts/<session>/summary.json and its schema (summary), the
atomic, masked writes behind it (artifacts), the one exit-code model (exitcodes), and the
rule that no process outlives its step (processes). It imports only specgate.core."""
