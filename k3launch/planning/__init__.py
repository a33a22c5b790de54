"""The pure planning core: recipes, inventories, resolution, composition, placement -> Plan. No I/O beyond reading YAML."""
