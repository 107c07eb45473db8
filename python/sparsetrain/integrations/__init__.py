"""sparsetrain inside the training stacks users already run, through their own extension points:
`sparsetrain.integrations.transformers` (Hugging Face transformers 5.x: importing it registers
`experts_implementation="sparsetrain"`)."""
