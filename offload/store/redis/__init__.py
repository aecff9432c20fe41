"""The Redis tier: `store.RedisStore`, its connection (`link`), value format (`value`), call bounds
(`call`) and budget scripts (`budget`). Nothing native is imported here (redis-py loads on connect)."""
