"""What the lab's experiments share: the rule primitives a config field is checked by
(`checks`), how numbers and references are shown (`display`), progress bars (`progress`),
result rows read back typed and written as tables (`tables`) and the acceptance sweep's
config and break-even rule (`acceptance_sweep`)."""
