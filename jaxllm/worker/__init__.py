"""The model runner side: persistent batch state, bucketed jitted steps."""
